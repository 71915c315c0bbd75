"""Starting the ``fleet`` CLI in a child process (``engine.launch``): its log is rotated, so that a
node agent or a worker that runs for weeks cannot fill the disk."""

from __future__ import annotations

from engine.launch import FleetProcess


def test_a_childs_log_rotates_past_its_cap(tmp_path):
    """A real ``fleet`` child that writes a few hundred bytes to stderr (argparse's usage of ``fleet
    worker`` and its complaint), into a log capped at 200 bytes: the log rotates to ``.1``, each
    file stays near the cap, and the last line is in the current log."""
    log = tmp_path / "logs" / "worker.log"
    child = FleetProcess(["worker", "--no-such-option"], log, max_bytes=200).start()
    assert child.proc.wait(60) != 0
    child.stop()  # its log written to the last line
    rotated = log.with_name("worker.log.1")
    assert rotated.exists()
    lines = (rotated.read_text() + log.read_text()).splitlines()
    longest = max(len(line) + 1 for line in lines)
    assert log.stat().st_size <= max(200, longest) and rotated.stat().st_size <= max(200, longest)
    assert log.read_text().splitlines()[-1].startswith("fleet worker: error:")
    assert not list(log.parent.glob("worker.log.2"))  # one old file is kept, no more
