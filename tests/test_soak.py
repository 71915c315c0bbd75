"""The soak's short form (``fleet bench soak`` runs it for an hour): four users chat through the API
for two minutes while the fleet's worker is killed every 40 s (at 40 and 80 s).  No request hangs, every error is
recovered by a retry, every kill is recovered, and the coordinator's memory does not grow."""

from __future__ import annotations


def test_users_keep_chatting_while_the_worker_is_killed(tiny_models, tmp_path, monkeypatch):
    from engine.bench.soak import run_soak

    monkeypatch.setenv("FLEETSHARD_HOME", str(tmp_path / "home"))
    report = run_soak(str(tiny_models["qwen2"]), users=4, minutes=2, kill_every_s=40, tokens=16, weights="f32",
                      warmup_s=10, log=lambda m: None)
    requests = report["rows"][0]
    assert requests["kills"] == 2 and requests["recoveries"] == 2, report
    assert requests["completed"] > 50 and requests["hung"] == 0 and requests["retry_failed"] == 0, report
    assert requests["errors"] == requests["retried_ok"]
    assert report["ratios"]["RSS growth, coordinator"] <= 1.10, report["rows"]
