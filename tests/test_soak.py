"""The soak's short forms (``fleet bench soak`` runs 32 users for ten minutes): users chat through the
API while the fleet's worker is killed at intervals: four users and one kill in half a minute (the
fast tier); eight users for a minute with two kills and the node's computer asleep (SIGSTOP) for 15 s
in between (the slow tier).  Every request is answered, or refused with a clear status (429 or 503
with a message); none is lost and none hangs; every kill is recovered, and the coordinator's memory
does not grow."""

from __future__ import annotations

import pytest

SOAKS = {"short": dict(users=4, minutes=0.5, kill_every_s=15, sleep_s=0, kills=1, sleeps=0),
         "long": dict(users=8, minutes=1, kill_every_s=20, sleep_s=15, kills=2, sleeps=1)}


@pytest.mark.parametrize("length", list(SOAKS))
def test_users_keep_chatting_while_the_worker_is_killed(length, tiny_models, tmp_path, monkeypatch):
    from engine.bench.soak import run_soak

    soak = SOAKS[length]
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    report = run_soak(str(tiny_models["qwen2"]), users=soak["users"], minutes=soak["minutes"],
                      kill_every_s=soak["kill_every_s"], sleep_s=soak["sleep_s"], tokens=16, weights="f32",
                      warmup_s=10, log=lambda m: None)
    requests = report["rows"][0]
    assert requests["kills"] == soak["kills"] and requests["sleeps"] == soak["sleeps"], report
    assert requests["recoveries"] >= soak["kills"], report
    # more than 25 requests a minute answered, and nothing lost or hung
    assert requests["completed"] > 25 * soak["minutes"], report
    assert requests["lost"] == 0 and requests["hung"] == 0, report
    assert report["ratios"]["RSS growth, coordinator"] <= 1.10, report["rows"]
