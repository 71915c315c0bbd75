"""Compute turns: a stage holding the turn keeps every other process and thread of this computer
waiting until it lets go, and a process that dies holding it frees it.  The microbatch benchmark's
schedule bound for stages taking turns reaches min(N, (compute + waiting) / compute) where the cores
can stay busy and falls short of it near the knee."""

from __future__ import annotations

import threading
import time

import pytest
from fleet_support import eventually, turn_held, waits_for_turn

from engine.bench.microbatch import schedule_bound
from engine.runtime.stages.turns import NO_TURNS, ComputeTurns, turns_identity


def _acquired_in_background(turns: ComputeTurns) -> threading.Event:
    got = threading.Event()

    def take():
        with turns:
            got.set()

    threading.Thread(target=take, daemon=True).start()
    return got


def test_a_turn_held_by_another_process_blocks_until_released(tmp_path):
    path = tmp_path / "compute.turns"
    with turn_held(path) as holder:
        got = _acquired_in_background(ComputeTurns(path))
        assert waits_for_turn(path), "never came to wait for the turn"
        assert not got.is_set(), "took the turn while another process held it"
        holder.stdin.close()
        assert got.wait(10), "the turn was not handed over"


def test_a_process_that_dies_holding_the_turn_frees_it(tmp_path):
    path = tmp_path / "compute.turns"
    with turn_held(path) as holder:
        got = _acquired_in_background(ComputeTurns(path))
        assert waits_for_turn(path) and not got.is_set()
        holder.kill()
        holder.wait()
        assert got.wait(10)


def test_threads_of_one_process_take_turns_too(tmp_path):
    turns = ComputeTurns(tmp_path / "compute.turns")
    with turns:
        got = _acquired_in_background(turns)
        assert eventually(lambda: turns.waiting == 1), "the second thread never came to wait"
        assert not got.is_set(), "a second thread took the turn (flock alone does not exclude threads)"
    assert got.wait(10)


def test_schedule_bound_meets_the_ideal_only_where_the_cores_can_stay_busy():
    assert schedule_bound([16.0, 22.0], 10.0, 1) == pytest.approx(1.0)
    # two streams' computes (76 ms) outlast a token's cycle (58 ms): the cores never idle
    assert schedule_bound([16.0, 22.0], 10.0, 2) == pytest.approx(58 / 38, rel=0.01)
    assert schedule_bound([20.0, 20.0], 50.0, 3) == pytest.approx(3.0, rel=0.01)
    # the knee: 88 ms of compute against an 86 ms cycle, but the 22 ms way back outlasts any one
    # compute of the other stream, so the cores idle while both travel
    knee = schedule_bound([12.0, 12.0, 20.0], 10.5, 2)
    assert 1.6 < knee < 0.95 * min(2, (44 + 42) / 44)
    assert schedule_bound([12.0, 12.0, 20.0], 10.5, 3) == pytest.approx(86 / 44, rel=0.01)


def test_stages_taking_one_computers_turns_are_known_by_one_identity(tmp_path):
    """What a worker reports, so that the coordinator keeps no more groups in flight than the
    computers it reaches can compute at once (``RemoteChain.depth``)."""
    here = ComputeTurns(tmp_path / "compute.turns")
    assert turns_identity(here) == turns_identity(ComputeTurns(tmp_path / "compute.turns"))
    assert turns_identity(here) != turns_identity(ComputeTurns(tmp_path / "other.turns"))
    assert turns_identity(NO_TURNS) is None


def test_a_thread_that_releases_the_turn_cannot_take_it_back_before_one_waiting(tmp_path):
    """Two copies of a model in one coordinator: the one that just computed waits behind the one
    already waiting (``threading.Lock`` let it take the turn straight back, starving the other)."""
    turns = ComputeTurns(tmp_path / "compute.turns")
    order = []

    def waiter():
        with turns:
            order.append("waiter")

    turns.__enter__()
    thread = threading.Thread(target=waiter)
    thread.start()
    while not turns._thread._waiters:  # queued behind us
        time.sleep(0.001)
    turns.__exit__(None, None, None)
    with turns:
        order.append("releaser")
    thread.join(10)
    assert order == ["waiter", "releaser"]
