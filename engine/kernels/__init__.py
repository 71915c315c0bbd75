"""Our own CPU kernels inside the shard's graph: the ``GGMLMatMul`` operation (``ggml_matmul.cpp``, an
OpenVINO extension that ``pip install`` builds with the machine's compiler) runs a carried GGUF matrix
from its own bits: Q4_0, Q4_1, Q4_K and Q6_K with our kernels (int8 products with AVX-512 VNNI,
AVX-VNNI or AVX2, the matrix in ``tiles``), every other type with ggml's (from its blocks).  A stage
compiled for exact mode keeps its activations in float: our kernels then multiply in float, and the
other types keep the CPU plugin's MatMuls.  ``engine.kernels.swap`` puts it in the graph.

It is the default on a CPU: faster than the CPU plugin's own compressed MatMuls (the stock path) for
one row at a time and for several (docs/benchmarks.md).  ``use(False)`` chooses the stock path for the
stages a process compiles from then on; where the extension was not built, or ggml's library (the
``libggml-python`` package) is missing, the stock path runs anyway.  ``path()`` says which one this
process uses and why.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

EXTENSION = "engine.kernels._ggml_matmul"  # the built library's module name (setup.py)
GGML_LIBRARIES = ("libggml-base.so.0", "libggml-cpu.so.0")  # loaded before the extension, in this order
OP = "GGMLMatMul"
GGML = "ggml"  # path() of a process whose CPU stages run the operation
STOCK = "stock"  # path() of one that runs the CPU plugin's own MatMuls

# the operation's ``kernel`` attribute: OWN is ours (ggml_matmul.cpp's, for tiles.TYPES, from the
# matrix's tiles, in the best instruction set the CPU has), GGML_KERNEL is ggml's vec_dot (every type,
# from its blocks), OWN_256 and OWN_AVX2 ours with AVX-VNNI or with AVX2 where the CPU has a better one
# (for the tests: every instruction set the machine has runs)
OWN, GGML_KERNEL, OWN_256, OWN_AVX2 = 0, 1, 2, 3

_wanted = True
_kernel = OWN
_loaded: dict[int, object] = {}  # id(core) -> the NodeFactory that builds the operation (None: it did not load)
_load_error: str | None = None  # why the built extension did not load


def use(wanted: bool, kernel: int = OWN) -> tuple[bool, int]:
    """Whether CPU stages compiled from now on in this process run the operation (when it is
    available) or the stock path, and with which ``kernel``; returns the choice it replaces.
    ``fleet bench profile --kernels`` and the tests compare the paths."""
    global _wanted, _kernel
    before = (_wanted, _kernel)
    _wanted, _kernel = bool(wanted), int(kernel)
    return before


def kernel() -> int:
    """The ``kernel`` attribute the operation gets in this process."""
    return _kernel


def library() -> Path | None:
    """The built extension, or None."""
    spec = importlib.util.find_spec(EXTENSION)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _ggml_folder() -> Path | None:
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib64"


def unavailable() -> str | None:
    """Why this process cannot run the operation, in words; None when it can."""
    if library() is None:
        return "the kernel extension was not built with this install (pip install needs a C++ compiler)"
    folder = _ggml_folder()
    if folder is None or not all((folder / name).is_file() for name in GGML_LIBRARIES):
        return "ggml's CPU library is missing (pip install libggml-python)"
    return _load_error


def factory(core):
    """The NodeFactory that builds ``GGMLMatMul``, with the extension added to ``core`` (once per
    core); None where it is unavailable or not wanted."""
    global _load_error
    if not _wanted:
        return None
    if id(core) in _loaded:
        return _loaded[id(core)]
    if unavailable():
        return None
    try:
        _dependencies()
        from openvino.utils.node_factory import NodeFactory  # deferred: only a CPU stage builds the op

        core.add_extension(str(library()))
        nodes = NodeFactory()
        nodes.add_extension(str(library()))
    except (OSError, RuntimeError) as exc:
        _load_error = f"the kernel extension does not load here: {exc}"
        _loaded[id(core)] = None
        return None
    _loaded[id(core)] = nodes
    return nodes


def _dependencies() -> None:
    """Loads what the extension links to: OpenVINO's runtime, and ggml's libraries, whose symbols it
    finds among the loaded ones."""
    import openvino  # noqa: F401 - deferred: loads OpenVINO's runtime library

    for name in GGML_LIBRARIES:
        ctypes.CDLL(str(_ggml_folder() / name), mode=ctypes.RTLD_GLOBAL)


def tile_width() -> int:
    """The matrix rows one vector of our kernels holds on this CPU (16: AVX-512 VNNI, 8: AVX-VNNI or
    AVX2), or 0 where it has no AVX2 or the extension is unavailable (ggml's kernels run then)."""
    if unavailable():
        return 0
    try:
        _dependencies()
        return int(ctypes.CDLL(str(library())).fleetshard_tile_width())
    except OSError:
        return 0


def path(core) -> tuple[str, str]:
    """(``GGML`` or ``STOCK``, why): which matrices this process's CPU stages run, in words."""
    if not _wanted:
        return STOCK, "the stock path was chosen"
    if factory(core) is None:
        return STOCK, unavailable()
    return GGML, "carried GGUF matrices run with ggml's CPU kernels"
