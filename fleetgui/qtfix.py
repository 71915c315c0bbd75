"""Workarounds for two PySide6 hazards: a reference-counting bug, and Qt objects freed on the wrong thread.

PySide6 6.12.0's ``SignalInstance.emit`` returns ``True`` without owning a reference to it: every
emit called from Python (ours, and pyqtgraph's on every plot update) takes one reference away from
``True``.  On Python 3.11, where ``True`` is an ordinary object, a long session or a busy test run
drives its count to zero and the interpreter aborts ("bool_dealloc: deallocating True or False").
``install()`` measures whether emit loses a reference here and, only then, wraps it to give the
reference back.  Python 3.12+ (immortal booleans) and fixed PySide6 versions are left untouched.

Python's cyclic garbage collector runs on whichever thread happens to allocate when a threshold is
crossed: in this app that is often an engine thread (the chat scheduler, a deployment, zeroconf), and a
cycle holding a widget's wrapper then runs Qt's destructor off the GUI thread, which corrupts memory
and crashes some time later, far from the cause.  ``collect_on_gui_thread()`` turns automatic
collection off and collects from a timer on the GUI thread instead, at the same thresholds.
"""

from __future__ import annotations

import ctypes
import gc
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


def collect_due() -> None:
    """One step of what the collector would do by itself with ``gc`` enabled: the oldest generation
    whose count is past its threshold (nothing when none is)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (2, 1, 0):
        if counts[generation] > thresholds[generation]:
            gc.collect(generation)
            return


def collect_on_gui_thread(app, interval_ms: int = 250):
    """Garbage collection from the GUI thread only (see the module's docstring); returns the timer."""
    from PySide6.QtCore import QTimer

    gc.disable()
    timer = QTimer(app)
    timer.timeout.connect(collect_due)
    timer.start(interval_ms)
    return timer
