"""OpenVINO libraries kept loaded for the life of the process (Linux).

OpenVINO loads and unloads libraries as it goes: every ``convert_model`` or ``read_model`` loads each
frontend to ask whether it reads the file and unloads the ones that do not, and every tokenizer opened
loads openvino-tokenizers' extension and unloads it when closed.  Several of those libraries hold
thread-local storage, and glibc 2.36 keeps its thread-local bookkeeping wrong after enough such
unloads: a thread started later aborts the process ("Inconsistency detected by ld.so: dl-tls.c ...
Assertion `listp != NULL' failed", exit status 127), far from the cause.  A handle held here on each
of them keeps their reference count above zero, so OpenVINO's unloads never unmap them.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
from pathlib import Path

# (package, folder inside it, file pattern)
LIBRARIES = (("openvino", "libs", "libopenvino_*_frontend.so*"),
             ("openvino_tokenizers", "lib", "libopenvino_tokenizers.so*"))
_handles: list = []


@functools.cache
def pin_libraries() -> None:
    """Loads each of ``LIBRARIES`` and keeps it (once per process; a library that does not load here
    is left to OpenVINO, which reports it if it needs it)."""
    if sys.platform != "linux":
        return
    for package, folder, pattern in LIBRARIES:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for library in sorted(Path(root, folder).glob(pattern)):
                try:
                    _handles.append(ctypes.CDLL(str(library)))
                except OSError:
                    pass
