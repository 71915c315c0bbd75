"""``GET /metrics``: Prometheus' text format, parsed by prometheus_client's own parser, adding up to
what the requests got (requests by status, tokens in and out, TTFT, per-stage forward time), and a
stage failure carried over by a failover counted as such."""

from __future__ import annotations

import http.client

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import Scheduling
from engine.errors import StageError
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.serve.server import ApiServer

MODEL = "tiny"


class FlakyChain:
    """A chain whose ``fail_at``-th forward fails at stage 1, as a worker that went away; it does not
    close the chain under it (the failover's new chain is the same one)."""

    def __init__(self, chain, fail_at: int | None = None):
        self._chain, self.fail_at, self.forwards = chain, fail_at, 0

    def __getattr__(self, name):
        return getattr(self._chain, name)

    def submit(self, *args, **kwargs):
        self.forwards += 1
        if self.forwards == self.fail_at:
            raise StageError(1, "127.0.0.1:1", "connection lost")
        return self._chain.submit(*args, **kwargs)

    def close(self):
        pass


@pytest.fixture(scope="module")
def chain(tiny_exports):
    return LocalChain(tiny_exports["qwen2", "2"].folders)


def _scrape(server) -> dict:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    assert response.status == 200 and response.getheader("content-type").startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_metrics_add_up_to_what_the_requests_got(chain):
    service = ChatService(chain, scheduling=Scheduling(streams=2))
    server = ApiServer(service, port=0, model_id=MODEL).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "The quick brown fox"}]
        whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
        text = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=5, temperature=0)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=messages, temperature=9)
        m = _scrape(server)
        usages = [whole.usage, streamed[-1].usage, text.usage]
        chat = "/v1/chat/completions"
        assert m["fleet_requests_total", (("endpoint", chat), ("status", "200"))] == 2
        assert m["fleet_requests_total", (("endpoint", chat), ("status", "400"))] == 1
        assert m["fleet_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))] == 1
        assert m["fleet_completion_tokens_total", ()] == sum(u.completion_tokens for u in usages)
        assert m["fleet_prompt_tokens_total", ()] == sum(u.prompt_tokens for u in usages)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
        assert m["fleet_cached_prompt_tokens_total", ()] == cached
        assert m["fleet_time_to_first_token_seconds_count", ()] == 3
        assert m["fleet_time_to_first_token_seconds_sum", ()] > 0
        for stage in ("0", "1"):  # every reply had decode rounds, each on both stages
            assert m["fleet_stage_forward_seconds_count", (("stage", stage),)] == 3
            assert m["fleet_stage_up", (("stage", stage),)] == 1
            assert m["fleet_stage_failures_total", (("stage", stage),)] == 0
        finished = sum(m["fleet_replies_total", (("finish_reason", r),)] for r in ("stop", "length")
                       if ("fleet_replies_total", (("finish_reason", r),)) in m)
        assert finished == 3
        assert (m["fleet_queue_depth", ()], m["fleet_requests_running", ()], m["fleet_streams", ()]) == (0, 0, 2)
        assert ("fleet_requests_total", (("endpoint", "/metrics"), ("status", "200"))) not in m  # counted once sent
        assert _scrape(server)["fleet_requests_total", (("endpoint", "/metrics"), ("status", "200"))] == 1
    finally:
        server.stop()
        service.close()


def test_a_failover_and_the_stage_that_failed_are_counted(chain):
    service = ChatService(FlakyChain(chain, fail_at=4), scheduling=Scheduling(streams=1),
                          recover=lambda error: FlakyChain(chain))
    server = ApiServer(service, port=0, model_id=MODEL).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Berlin is"}],
                                               max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 10  # it carried on over the new chain
        m = _scrape(server)
        assert m["fleet_failovers_total", (("outcome", "recovered"),)] == 1
        assert m["fleet_failovers_total", (("outcome", "failed"),)] == 0
        assert m["fleet_stage_failures_total", (("stage", "1"),)] == 1
        assert m["fleet_stage_up", (("stage", "1"),)] == 1  # back up: the new chain serves
    finally:
        server.stop()
        service.close()
