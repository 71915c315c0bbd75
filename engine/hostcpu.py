"""This machine's CPU as the fleet reports it: its model name, and which int8 dot-product instructions
it has.

The second decides how fast OpenVINO's own kernels (the stock path) run a compressed shard on the
CPU.  With AVX-VNNI, AVX-512 VNNI or AMX the plugin quantizes each matrix's activations to int8 and
multiplies them by the weights' integer codes; without them it turns every weight back into a float
first, at a fraction of llama.cpp's speed (docs/benchmarks.md).  Our kernels (``engine.kernels``)
do not depend on it: ``engine.fleet.node.runs_slowly`` says where both hold.
"""

from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo's flag for each, best first
INT8_FLAGS = (("amx_int8", "AMX"), ("avx512_vnni", "AVX-512 VNNI"), ("avx_vnni", "AVX-VNNI"))
NONE = "none"
SLOW = "no int8 dot products and OpenVINO's own kernels: slow here"  # a one-line INT8_NOTE
INT8_NOTE = ("This CPU has no int8 dot-product instructions (AVX-VNNI, AVX-512 VNNI or AMX), and its "
             "stages run OpenVINO's own kernels (this install has no kernel extension), which turn every "
             "weight back into a float before multiplying: about half the speed of our kernels. It still "
             "serves; placement gives it work by its measured speed.")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_model(fallback: str = "") -> str:
    """The model name ("Intel(R) Core(TM) Ultra 7 155H"): /proc/cpuinfo's on Linux, else ``fallback``
    (OpenVINO's name for the CPU), else what ``platform`` says."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return fallback or platform.processor() or platform.machine()


def int8_dot(cpuinfo: str | None = None) -> str:
    """The best int8 dot-product instructions the CPU has ("AMX", "AVX-512 VNNI", "AVX-VNNI"),
    ``NONE``, or "" where it cannot be told (no /proc/cpuinfo; numpy can tell AVX-512 VNNI, not
    AVX-VNNI, so elsewhere only a "yes" is known)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return next((name for flag, name in INT8_FLAGS if flag in flags), NONE)
    try:  # numpy 2's private module (deferred: Linux never needs it)
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:
        return ""
    return "AVX-512 VNNI" if __cpu_features__.get("AVX512VNNI") else ""
