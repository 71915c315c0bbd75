"""A workaround for a reference-counting bug in the installed PySide6.

PySide6 6.12.0's ``SignalInstance.emit`` returns ``True`` without owning a reference to it: every
emit called from Python (ours, and pyqtgraph's on every plot update) takes one reference away from
``True``.  On Python 3.11, where ``True`` is an ordinary object, a long session or a busy test run
drives its count to zero and the interpreter aborts ("bool_dealloc: deallocating True or False").
``install()`` measures whether emit loses a reference here and, only then, wraps it to give the
reference back.  Python 3.12+ (immortal booleans) and fixed PySide6 versions are left untouched.
"""

from __future__ import annotations

import ctypes
import sys

_installed = False


def install() -> bool:
    """Returns True when the wrapper was needed and installed."""
    global _installed
    if _installed or sys.version_info >= (3, 12):
        return _installed
    from PySide6.QtCore import QObject, Signal, SignalInstance

    class _Probe(QObject):
        probe = Signal()

    probe = _Probe()
    calls = 16
    before = sys.getrefcount(True)
    for _ in range(calls):
        probe.probe.emit()
    lost = before - sys.getrefcount(True)
    if lost < calls:
        return False
    incref = ctypes.pythonapi.Py_IncRef
    incref.argtypes = [ctypes.py_object]
    incref.restype = None
    emit = SignalInstance.emit

    def emit_keeping_refcount(self, *args):
        result = emit(self, *args)
        if result is True:
            incref(True)
        return result

    SignalInstance.emit = emit_keeping_refcount
    for _ in range(lost):  # what the probe took
        incref(True)
    _installed = True
    return True
