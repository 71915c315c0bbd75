"""The soak's short forms (``fleet bench soak`` runs it for an hour): four users chat through the API
while the fleet's worker is killed at intervals: once in half a minute (the fast tier), twice in two
minutes (at 40 and 80 s, the slow tier).  No request hangs, every error is recovered by a retry, every
kill is recovered, and the coordinator's memory does not grow."""

from __future__ import annotations

import pytest

SOAKS = {"short": dict(minutes=0.5, kill_every_s=15, kills=1), "long": dict(minutes=2, kill_every_s=40, kills=2)}


@pytest.mark.parametrize("length", list(SOAKS))
def test_users_keep_chatting_while_the_worker_is_killed(length, tiny_models, tmp_path, monkeypatch):
    from engine.bench.soak import run_soak

    soak = SOAKS[length]
    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    report = run_soak(str(tiny_models["qwen2"]), users=4, minutes=soak["minutes"], kill_every_s=soak["kill_every_s"],
                      tokens=16, weights="f32", warmup_s=10, log=lambda m: None)
    requests = report["rows"][0]
    assert requests["kills"] == soak["kills"] and requests["recoveries"] == soak["kills"], report
    # in two minutes of the long form, more than 50 requests; as many a minute in the short one
    assert requests["completed"] > 25 * soak["minutes"] and requests["hung"] == 0, report
    assert requests["retry_failed"] == 0 and requests["errors"] == requests["retried_ok"], report
    assert report["ratios"]["RSS growth, coordinator"] <= 1.10, report["rows"]
