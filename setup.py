"""The build of the kernel extension (engine/kernels/ggml_matmul.cpp, with tile_kernels.inc): a shared
library OpenVINO loads with ``Core.add_extension``, compiled against the openvino wheel's headers and
ggml's (libggml-python) with the machine's C++ compiler.  It is optional: where it cannot be built the
install goes on and the CPU plugin's own MatMuls run (engine.kernels says which path a process uses)."""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _package(name: str) -> Path:
    return Path(list(importlib.util.find_spec(name).submodule_search_locations)[0])


def _extensions() -> list[Extension]:
    if not sys.platform.startswith("linux"):
        return []  # the link below names GNU ld's versioned libraries; elsewhere the stock path runs
    try:
        openvino, ggml = _package("openvino"), _package("libggml")
    except (AttributeError, TypeError):  # not in the build environment: the stock path runs
        return []
    libs = openvino / "libs"
    versioned = sorted(p.name for p in libs.glob("libopenvino.so.*"))[:1] + ["libtbb.so.12"]
    return [Extension(
        "engine.kernels._ggml_matmul",
        sources=["engine/kernels/ggml_matmul.cpp"],
        depends=["engine/kernels/tile_kernels.inc"],
        include_dirs=[str(openvino / "include"), str(ggml / "include")],
        library_dirs=[str(libs), str(ggml / "lib64")],
        libraries=[f":{name}" for name in versioned] + ["ggml-base", "ggml-cpu"],
        extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
        language="c++",
        optional=True,
    )]


class _BuildLibrary(build_ext):
    """Builds the extension as a plain shared library: it exports OpenVINO's create_extensions, not a
    Python module's init function."""

    def get_export_symbols(self, ext):
        return []


setup(ext_modules=_extensions(), cmdclass={"build_ext": _BuildLibrary})
