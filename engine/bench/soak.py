"""``fleet bench soak``: users chatting through the OpenAI-compatible API for a long time while the
fleet under it loses its worker again and again.

The fleet is the app's embedded default: stage 0 in this process, the later stages in the workers of
a node agent process on loopback, with failover (``engine.fleet.failover``) starting a killed worker
again.  ``users`` threads send chat requests (the official client, one at a time each, a different
prompt each time) until the time is up; every ``kill_every_s`` the worker is killed (kill -9).

Reported: requests completed; requests that ended in an error (each is retried once, and the retry
must succeed); hung requests (no answer within ``HANG_S``: must be none); kills and the recoveries
failover made; latency p50/p95; the RSS of the coordinator, the agent and the worker, after the
warm-up and at the end.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from engine.bench.harness import PROMPTS, rss_mb
from engine.bench.report import write_report
from engine.config import DEFAULT_WEIGHTS, Settings
from engine.fleetkey import create_key, load_key
from engine.runtime.decode.service import ChatService
from engine.serve.server import ApiServer
from engine.session import Launch, open_chain, open_failover

HANG_S = 120.0


def _worker_pid(agent_pid: int) -> int | None:
    children = [p for p in psutil.Process(agent_pid).children() if p.is_running()]
    return children[0].pid if children else None


def run_soak(model: str = "smollm2-135m", *, users: int = 8, minutes: float = 60.0, kill_every_s: float = 300.0,
             tokens: int = 32, stages: int = 2, weights: str = DEFAULT_WEIGHTS, warmup_s: float = 20.0,
             out: Path | None = None, log=print) -> dict:
    # the OpenAI client is a test extra: only the soak's users need it
    import openai

    prompts = list(PROMPTS.values())
    with tempfile.TemporaryDirectory() as tmp:
        key_file = create_key(Path(tmp) / "fleet.key")
        events: list[str] = []
        settings = Settings(default_model=model, stages=stages, weights=weights, fleet_key_file=str(key_file))
        opened = open_chain(settings, Launch())  # the local fleet, as `fleet up` and the app run it
        agent = opened.owned[0].proc
        failover = open_failover(opened, settings, on_event=lambda text: (events.append(text), log(f"fleet: {text}")))
        service = ChatService(opened.chain, streams=users, recover=failover.recover)
        server = ApiServer(service, port=0, model_id=model).start()
        stats = {"completed": 0, "errors": 0, "retried_ok": 0, "retry_failed": 0, "hung": 0}
        latencies: list[float] = []
        lock = threading.Lock()
        stop = threading.Event()
        error_texts: list[str] = []

        def ask(client, prompt: str):
            began = time.perf_counter()
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=tokens, temperature=0)
            return reply, time.perf_counter() - began

        def user(index: int) -> None:
            client = openai.OpenAI(base_url=server.url, api_key="soak", max_retries=0, timeout=HANG_S)
            n = index
            while not stop.is_set():
                prompt = f"{prompts[n % len(prompts)]} (request {n})"
                n += users
                try:
                    _, seconds = ask(client, prompt)
                    with lock:
                        stats["completed"] += 1
                        latencies.append(seconds)
                except openai.APITimeoutError:
                    with lock:
                        stats["hung"] += 1
                except openai.APIError as exc:
                    with lock:
                        stats["errors"] += 1
                        error_texts.append(str(exc)[:200])
                    try:
                        ask(client, prompt)
                        with lock:
                            stats["retried_ok"] += 1
                    except openai.APIError:
                        with lock:
                            stats["retry_failed"] += 1

        threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
        try:
            for t in threads:
                t.start()
            time.sleep(warmup_s)
            start = {"coordinator": rss_mb(os.getpid()), "agent": rss_mb(agent.pid),
                     "worker": rss_mb(_worker_pid(agent.pid) or 0)}
            with lock:
                stats.update({k: 0 for k in stats})
                latencies.clear()
            log(f"warm: RSS coordinator {start['coordinator']:.0f} MB, agent {start['agent']:.0f} MB, "
                f"worker {start['worker']:.0f} MB")
            began, kills = time.monotonic(), 0
            next_kill = began + kill_every_s
            while time.monotonic() - began < minutes * 60:
                time.sleep(min(1.0, max(0.0, next_kill - time.monotonic())))
                if time.monotonic() >= next_kill:
                    # none in the last half interval: users must still be asking for failover to act
                    pid = _worker_pid(agent.pid) if next_kill - began <= minutes * 60 - kill_every_s / 2 else None
                    if pid:
                        os.kill(pid, signal.SIGKILL)
                        kills += 1
                        log(f"killed the worker (pid {pid}) at {time.monotonic() - began:.0f} s")
                    next_kill += kill_every_s
            stop.set()
            for t in threads:
                t.join(HANG_S + 10)
            end = {"coordinator": rss_mb(os.getpid()), "agent": rss_mb(agent.pid),
                   "worker": rss_mb(_worker_pid(agent.pid) or 0)}
            recoveries = failover.recoveries
        finally:
            stop.set()
            server.stop()
            service.close()
            failover.deployment.stop(load_key(key_file))
            opened.owned[0].close()
    seconds = np.array(latencies or [0.0])
    summary = {**stats, "kills": kills, "recoveries": recoveries, "minutes": minutes, "users": users,
               "latency_p50_s": round(float(np.percentile(seconds, 50)), 3),
               "latency_p95_s": round(float(np.percentile(seconds, 95)), 3)}
    rows = [{"part": "requests", **summary}]
    rows += [{"part": "rss", "process": name, "start_mb": round(start[name], 1), "end_mb": round(end[name], 1),
              "growth": round(end[name] / start[name], 3) if start[name] else None} for name in start]
    ratios = {f"RSS growth, {row['process']}": row["growth"] for row in rows[1:]}
    ratios.update({"hung requests": stats["hung"], "errors not recovered by a retry": stats["retry_failed"]})
    settings = {"model": model, "stages": stages, "weights": weights, "tokens": tokens, "kill_every_s": kill_every_s,
                "warmup_s": warmup_s, "errors": error_texts[:10], "events": events[-20:]}
    return write_report("soak", rows, ratios, out, settings=settings)
