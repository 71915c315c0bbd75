"""What ``GET /metrics`` tells Prometheus about the API and the fleet under it.

Counted per request by the app (``observe_reply``, ``observe_status``): requests by endpoint and
HTTP status, replies by finish reason, tokens in (cached or not) and out, time to first token and
the time between tokens (each reply's mean), and each stage's compute per decode forward.  Read at
scrape time from the ``ChatService``: requests queued and generating, stages up, forwards that
failed per stage, and failovers (a new chain the replies carried on over, or not).  One registry per
app, so that several servers in one process keep their own counts.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.runtime.decode.service import ChatService, Reply

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, service: ChatService):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fleet_requests", "API requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.replies = Counter("fleet_replies", "replies finished, by finish reason (stop, length, cancelled, error)",
                               ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("fleet_prompt_tokens", "prompt tokens of the replies", registry=r)
        self.cached_tokens = Counter("fleet_cached_prompt_tokens", "prompt tokens the prefix cache held",
                                     registry=r)
        self.completion_tokens = Counter("fleet_completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("fleet_time_to_first_token_seconds", "prompt in to first token out, per reply",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("fleet_inter_token_seconds", "a reply's mean time between two tokens",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.stage_forward = Histogram("fleet_stage_forward_seconds",
                                       "a stage's compute per decode forward (each reply's mean)", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        r.register(_ServiceCollector(service))

    def observe_status(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_reply(self, reply: Reply) -> None:
        self.replies.labels(reply.finish_reason).inc()
        self.prompt_tokens.inc(reply.prompt_tokens)
        self.cached_tokens.inc(reply.cached_tokens)
        self.completion_tokens.inc(len(reply.tokens))
        if reply.tokens and not reply.error:
            self.ttft.observe(reply.ttft_ms / 1e3)
        if reply.decode_tok_s > 0:
            self.inter_token.observe(1.0 / reply.decode_tok_s)
        if reply.rounds:
            for stage, ms in enumerate(reply.stage_ms):
                self.stage_forward.labels(str(stage)).observe(ms / reply.rounds / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ServiceCollector:
    """The service's state, read when Prometheus scrapes."""

    def __init__(self, service: ChatService):
        self.service = service

    def collect(self):
        s = self.service
        queued, busy = s.queued, s.busy
        yield GaugeMetricFamily("fleet_queue_depth", "requests waiting for a free stream", value=queued)
        yield GaugeMetricFamily("fleet_requests_running", "requests generating", value=busy - queued)
        yield GaugeMetricFamily("fleet_streams", "streams (requests that can generate at once)", value=s.streams)
        up = GaugeMetricFamily("fleet_stage_up", "1 while the stage serves, 0 after a forward failed there "
                               "until a reply goes through again", labels=["stage"])
        for stage, ok in enumerate(s.stages_up):
            up.add_metric([str(stage)], 1.0 if ok else 0.0)
        yield up
        failures = CounterMetricFamily("fleet_stage_failures", "forwards that failed at a stage", labels=["stage"])
        for stage in range(len(s.stages_up)):
            failures.add_metric([str(stage)], s.stage_failures.get(stage, 0))
        yield failures
        failovers = CounterMetricFamily("fleet_failovers", "chain failures the replies carried on over "
                                        "(recovered) or ended with (failed)", labels=["outcome"])
        for outcome in ("recovered", "failed"):
            failovers.add_metric([outcome], s.failovers.get(outcome, 0))
        yield failovers
