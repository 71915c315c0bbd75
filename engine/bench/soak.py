"""``fleet bench soak``: users chatting through the OpenAI-compatible API for a long time while the
fleet under it loses its worker again and again.

The fleet is the app's embedded default: stage 0 in this process, the later stages in the workers of
a node agent process on loopback, with failover (``engine.fleet.failover``) starting a killed worker
again.  ``users`` threads send chat requests (the official client, one at a time each, a different
prompt each time) until the time is up; every ``kill_every_s`` the worker is killed (kill -9), and
once, halfway, the node's computer sleeps for ``sleep_s`` (its agent and worker are stopped with
SIGSTOP, as a closed lid, and continued with SIGCONT).

Every request ends in one of four ways: answered; refused with a clear status (429 or 503 with a
message, which the user retries once); lost (any other failure: a 5xx without a message, a broken
connection); or hung (no answer within ``HANG_S``).  Nothing may be lost or hung.  Also reported:
kills, sleeps and the recoveries failover made; latency p50/p95 and the longest request; the RSS
of the coordinator, the agent and the worker, after the warm-up and at the end.
"""

from __future__ import annotations

import collections
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
from engine.config import DEFAULT_WEIGHTS, Scheduling, Settings
from engine.fleetkey import create_key
from engine.runtime.decode.service import ChatService
from engine.serve.server import ApiServer
from engine.session import Launch, open_chain, open_failover

HANG_S = 120.0  # the bound on every request: one that takes longer counts as hung
CLEAR = (429, 503)  # the statuses that refuse a request plainly (with a message saying why)


def _worker_pid(agent_pid: int) -> int | None:
    children = [p for p in psutil.Process(agent_pid).children() if p.is_running()]
    return children[0].pid if children else None


def _node_processes(agent_pid: int) -> list[psutil.Process]:
    """The node's agent and its workers: what a sleeping computer stops."""
    agent = psutil.Process(agent_pid)
    return [agent, *agent.children(recursive=True)]


def run_soak(model: str = "smollm2-135m", *, users: int = 32, minutes: float = 10.0, kill_every_s: float = 60.0,
             sleep_s: float = 60.0, tokens: int = 32, stages: int = 2, weights: str = DEFAULT_WEIGHTS,
             warmup_s: float = 20.0, out: Path | None = None, log=print) -> dict:
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
        service = ChatService(opened.chain, scheduling=Scheduling(streams=users), recover=failover.recover)
        server = ApiServer(service, port=0, model_id=model).start()
        stats = {"completed": 0, "refused": 0, "lost": 0, "hung": 0, "retried_ok": 0, "retry_refused": 0}
        statuses: collections.Counter = collections.Counter()
        latencies: list[float] = []
        longest = [0.0]
        lock = threading.Lock()
        stop = threading.Event()
        error_texts: list[str] = []

        def ask(client, prompt: str):
            began = time.perf_counter()
            reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=tokens, temperature=0)
            return reply, time.perf_counter() - began

        def outcome(client, prompt: str) -> str:
            """One request's end: "completed", "refused" (429 or 503 with a message), "lost" or "hung"."""
            began = time.perf_counter()
            try:
                _, seconds = ask(client, prompt)
            except openai.APITimeoutError:
                with lock:
                    statuses["no answer"] += 1
                return "hung"
            except openai.APIStatusError as exc:
                body = exc.body if isinstance(exc.body, dict) else {}
                message = (body["error"] if isinstance(body.get("error"), dict) else body).get("message")
                clear = exc.status_code in CLEAR and bool(message)
                with lock:
                    statuses[str(exc.status_code)] += 1
                    longest[0] = max(longest[0], time.perf_counter() - began)
                    if not clear:
                        error_texts.append(f"{exc.status_code}: {str(exc)[:200]}")
                return "refused" if clear else "lost"
            except openai.APIError as exc:  # a broken connection, an unreadable answer
                with lock:
                    statuses[type(exc).__name__] += 1
                    error_texts.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                return "lost"
            with lock:
                statuses["200"] += 1
                latencies.append(seconds)
                longest[0] = max(longest[0], seconds)
            return "completed"

        def user(index: int) -> None:
            client = openai.OpenAI(base_url=server.url, api_key="soak", max_retries=0, timeout=HANG_S)
            n = index
            while not stop.is_set():
                prompt = f"{prompts[n % len(prompts)]} (request {n})"
                n += users
                ended = outcome(client, prompt)
                with lock:
                    stats[ended] += 1
                if ended == "refused":  # a user tries again once, after the Retry-After a 429 names
                    time.sleep(2.0)
                    again = outcome(client, prompt)
                    with lock:
                        stats[again if again in ("lost", "hung") else
                              "retried_ok" if again == "completed" else "retry_refused"] += 1

        threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
        try:
            for t in threads:
                t.start()
            time.sleep(warmup_s)
            start = {"coordinator": rss_mb(os.getpid()), "agent": rss_mb(agent.pid),
                     "worker": rss_mb(_worker_pid(agent.pid) or 0)}
            with lock:
                stats.update({k: 0 for k in stats})
                statuses.clear()
                latencies.clear()
                longest[0] = 0.0
            log(f"warm: RSS coordinator {start['coordinator']:.0f} MB, agent {start['agent']:.0f} MB, "
                f"worker {start['worker']:.0f} MB")
            began, kills, sleeps = time.monotonic(), 0, 0
            next_kill = began + kill_every_s
            sleep_at = began + minutes * 60 / 2 - sleep_s / 2 if sleep_s else float("inf")
            while time.monotonic() - began < minutes * 60:
                time.sleep(min(1.0, max(0.0, min(next_kill, sleep_at) - time.monotonic())))
                if time.monotonic() >= sleep_at:
                    sleep_at = float("inf")
                    asleep = _node_processes(agent.pid)
                    for proc in asleep:
                        proc.send_signal(signal.SIGSTOP)
                    log(f"the node sleeps (SIGSTOP to {len(asleep)} processes) at {time.monotonic() - began:.0f} s")
                    time.sleep(sleep_s)
                    for proc in asleep:
                        if proc.is_running():
                            proc.send_signal(signal.SIGCONT)
                    sleeps += 1
                    log(f"the node wakes (SIGCONT) at {time.monotonic() - began:.0f} s")
                    next_kill = max(next_kill, time.monotonic() + kill_every_s / 2)
                    continue
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
            failover.deployment.stop(failover.access)
            opened.owned[0].close()
    seconds = np.array(latencies or [0.0])
    summary = {**stats, "statuses": dict(statuses), "kills": kills, "sleeps": sleeps, "recoveries": recoveries,
               "minutes": minutes, "users": users, "hang_bound_s": HANG_S,
               "latency_p50_s": round(float(np.percentile(seconds, 50)), 3),
               "latency_p95_s": round(float(np.percentile(seconds, 95)), 3), "longest_s": round(longest[0], 3)}
    rows = [{"part": "requests", **summary}]
    rows += [{"part": "rss", "process": name, "start_mb": round(start[name], 1), "end_mb": round(end[name], 1),
              "growth": round(end[name] / start[name], 3) if start[name] else None} for name in start]
    ratios = {f"RSS growth, {row['process']}": row["growth"] for row in rows[1:]}
    ratios.update({"hung requests": stats["hung"], "lost requests": stats["lost"]})
    settings = {"model": model, "stages": stages, "weights": weights, "tokens": tokens, "kill_every_s": kill_every_s,
                "sleep_s": sleep_s,
                "warmup_s": warmup_s, "errors": error_texts[:10], "events": events[-20:]}
    return write_report("soak", rows, ratios, out, settings=settings)
