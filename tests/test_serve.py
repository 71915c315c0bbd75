"""The OpenAI-compatible API (``fleet serve``) with the official ``openai`` client as the real client:
chat and text completions, streamed and not, stop strings and lengths, several clients at once,
bad requests answered with OpenAI-shaped 400s naming the field, a client that goes away cancelling
its reply, and the API key off loopback."""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest

from api_support import reply_text

from engine.config import Scheduling
from engine.errors import FleetError
from engine.runtime.decode.service import ChatService
from engine.runtime.decode.speculative import stream_drafters
from engine.runtime.stages.chain import LocalChain
from engine.runtime.stages.stage import compile_config
from engine.serve.server import ApiServer

MODEL = "tiny"


class SlowChain:
    """A chain whose every forward takes at least ``delay_s``: a slow fleet, so that a reply is still
    being made when its client goes away."""

    def __init__(self, chain, delay_s: float):
        self._chain, self.delay_s = chain, delay_s

    def __getattr__(self, name):
        return getattr(self._chain, name)

    def submit(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return self._chain.submit(*args, **kwargs)


@pytest.fixture(scope="module")
def chain(tiny_exports):
    # exact mode: replies that reuse a stream's cached prefix are the very tokens of cold ones
    return LocalChain(tiny_exports["qwen2", "2"].folders, config=compile_config("exact"))


@pytest.fixture(scope="module")
def served(chain):
    service = ChatService(chain, scheduling=Scheduling(streams=4, k=3), drafters=lambda n: stream_drafters("lookup", n),
                          rewind="trim")
    server = ApiServer(service, port=0, model_id=MODEL).start()
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    yield service, server, client
    server.stop()
    service.close()


def _alone(service, messages, tokens, chat=True):
    return service.submit(messages, tokens, chat=chat).wait(60)


def _raw(server, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, json.loads(payload) if payload else None


def test_models_and_health(served):
    service, server, client = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, doc = _raw(server, "GET", "/health")
    assert status == 200 and doc["status"] == "ok" and doc["model"] == MODEL and doc["streams"] == 4


def test_chat_completion_equals_the_service_greedy_reply(served):
    service, server, client = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    want = _alone(service, messages, 20)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason == ("length" if len(want.tokens) == 20 else "stop")
    assert got.usage.prompt_tokens == want.prompt_tokens > 5
    assert got.usage.completion_tokens == len(want.tokens)
    assert got.usage.total_tokens == want.prompt_tokens + len(want.tokens)
    assert got.id.startswith("chatcmpl-") and got.model == MODEL


def test_streamed_chat_adds_up_and_reports_usage(served):
    service, server, client = served
    messages = [{"role": "user", "content": "def add(a, b):"}]
    want = _alone(service, messages, 24)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == want.text and finishes == [want.finish_reason]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it did stream
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
    # without include_usage no usage chunk is sent
    plain = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_text_completion_streamed_and_not(served):
    service, server, client = served
    prompt = "Paris is the capital of"
    want = _alone(service, [{"role": "user", "content": prompt}], 16, chat=False)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == want.text and got.object == "text_completion"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_sampling_through_the_api(served):
    service, server, client = served
    messages = [{"role": "user", "content": "A fleet of laptops"}]

    def ask(extra=None, **kw):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, **kw,
                                              extra_body={"ignore_eos": True, **(extra or {})}
                                              ).choices[0].message.content

    seeded = [ask(temperature=1.2, seed=11), ask(temperature=1.2, seed=11), ask(temperature=1.2, seed=12)]
    assert seeded[0] == seeded[1] != seeded[2]
    greedy = ask(temperature=0)
    assert greedy == _alone(service, messages, 24).text != seeded[0]
    # the top_k extension reaches the sampler: the one likeliest token is greedy at any temperature
    assert ask(temperature=1.5, seed=3, extra={"top_k": 1}) == greedy


def test_stop_strings_and_length(served):
    service, server, client = served
    messages = [{"role": "user", "content": "A fleet of laptops"}]
    full = _alone(service, messages, 40).text
    cut = len(full) // 2
    stop = full[cut : cut + 3]
    assert stop.strip() and len(stop) == 3
    want = full[: full.index(stop)]
    for stream in (False, True):
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                  stop=[stop, "never appears"], stream=stream)
        text, finish = reply_text(response, stream)
        assert (text, finish) == (want, "stop")
    short = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_several_clients_at_once_match_their_replies_alone(served):
    service, server, client = served
    prompts = ["The quick brown fox", "def add(a, b):", "Paris", "A fleet", "Berlin is", "return a"]
    alone = [_alone(service, [{"role": "user", "content": p}], 16).text for p in prompts]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        own = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        stream = own.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i]}],
                                             max_tokens=16, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].delta.content or "" for c in stream)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(prompts))] == alone


@pytest.mark.parametrize("body, param, status", [
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", 400),
    ({"messages": []}, "messages", 400),
    ({}, "messages", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     "stream_options", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4o"}, "model", 404),
])
def test_bad_requests_get_openai_errors_naming_the_field(served, body, param, status):
    service, server, client = served
    code, doc = _raw(server, "POST", "/v1/chat/completions", {"model": MODEL, **body})
    assert code == status, doc
    assert doc["error"]["param"] == param and doc["error"]["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in doc["error"]["message"] or "Unrecognized" in doc["error"]["message"]


def test_a_tool_schema_that_is_not_an_object_is_a_400(served):
    """A call's arguments are an object: a schema of another type (a string here, whose call would
    carry arguments that are not JSON) is refused, naming the field."""
    _, _, client = served
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {"type": "string", "enum": ["go"]}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go?"}], tools=tools,
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=50)
    assert caught.value.body["param"] == "tools[0].function.parameters"
    assert 'schema\'s type is "object", not "string"' in caught.value.body["message"]


def test_bad_requests_through_the_client_and_malformed_bodies(served):
    service, server, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert caught.value.status_code == 400 and "temperature" in str(caught.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        code, doc = _raw(server, "POST", "/v1/chat/completions", raw)
        assert code == 400 and doc["error"]["type"] == "invalid_request_error", (raw, doc)
    for prompt in (["a", ""], "", []):
        code, doc = _raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": prompt})
        assert code == 400 and doc["error"]["param"] == "prompt"
    reply = service.submit([{"role": "user", "content": ""}], 4, chat=False).wait(10)
    assert reply.stopped_by == "error" and "the prompt is empty" in reply.error  # the engine says so itself


def _recording(service):
    handles = []
    submit = service.submit

    def record(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    return handles, record


def test_a_client_that_goes_away_cancels_its_reply(chain, monkeypatch):
    service = ChatService(SlowChain(chain, 0.02), scheduling=Scheduling(streams=2))
    server = ApiServer(service, port=0, model_id=MODEL).start()
    handles, record = _recording(service)
    monkeypatch.setattr(service, "submit", record)
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "The quick brown fox"}],
                "max_tokens": 300, "temperature": 0}
        # streamed: read a few events, then hang up
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        for _ in range(3):
            response.fp.readline()
        conn.close()
        # not streamed: the client gives up waiting
        impatient = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(**body)
        replies = [h.wait(30) for h in handles]
        assert [r.stopped_by for r in replies] == ["cancelled", "cancelled"], [r.to_json() for r in replies]
        assert all(len(r.tokens) < 100 for r in replies)
        assert service.busy == 0
    finally:
        server.stop()
        service.close()


def test_api_key_is_required_off_loopback_and_checked(chain):
    service = ChatService(chain, scheduling=Scheduling(streams=1))
    try:
        with pytest.raises(FleetError, match="API key"):
            ApiServer(service, host="0.0.0.0", port=0, model_id=MODEL)
        server = ApiServer(service, port=0, api_key="fs-test-key-0123456789", model_id=MODEL).start()
        try:
            messages = [{"role": "user", "content": "hi"}]
            for key in ("wrong-key", None):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                code, doc = _raw(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": messages},
                                 headers)
                assert code == 401 and doc["error"]["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
            good = openai.OpenAI(base_url=server.url, api_key="fs-test-key-0123456789", max_retries=0)
            assert good.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).choices
            assert _raw(server, "GET", "/health")[0] == 200  # monitoring needs no key
        finally:
            server.stop()
    finally:
        service.close()


def test_a_busy_port_is_a_clear_error(served, chain):
    service, server, _ = served
    with pytest.raises(FleetError, match=f"cannot serve the API on 127.0.0.1:{server.port}"):
        ApiServer(service, port=server.port, model_id=MODEL)


def _serve_process(*args: str, env=None):
    """``fleet serve ... --port 0`` as a process; returns it and the URL it printed once ready."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise AssertionError(f"fleet serve did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc, line.split()[1]


def _ends_cleanly(proc) -> None:
    import signal

    import psutil

    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # the local fleet's worker process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stderr.read()[-2000:]
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive


def test_fleet_serve_over_a_local_worker_process(tiny_exports, tmp_path):
    folders = tiny_exports["llama", "2"].folders
    want = ChatService(LocalChain(folders), scheduling=Scheduling(streams=1))
    try:
        alone = want.submit([{"role": "user", "content": "The quick brown fox"}], 12).wait(60)
    finally:
        want.close()
    proc, url = _serve_process("--shards", *map(str, folders), "--local-workers", "--model-id", "tiny-llama",
                               env={"FLEETSHARD_HOME": str(tmp_path)})
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        got = client.chat.completions.create(model="tiny-llama", max_tokens=12, temperature=0,
                                             messages=[{"role": "user", "content": "The quick brown fox"}])
        assert got.choices[0].message.content == alone.text
        _ends_cleanly(proc)
    finally:
        proc.kill()


@pytest.mark.real_model
def test_fleet_serve_answers_with_the_real_smollm2_and_survives_its_worker():
    """`fleet serve` with no chain named runs what `fleet up` and the app run: the default model on a
    local 2-stage fleet whose worker a local agent keeps; a killed worker is started again.  Exact
    mode: at the fast settings of a CPU with int8 dot products, the dynamic int8 activations turn
    this 135M model's answer to nonsense (tests/DURATIONS.md names the host)."""
    import os
    import signal

    import psutil

    proc, url = _serve_process("--model", "smollm2-135m", "--draft", "lookup", "--mode", "exact")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        first = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=64, messages=ask)
        assert "Paris" in first.choices[0].message.content
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "worker" in p.cmdline()]
        assert len(workers) == 1
        os.kill(workers[0].pid, signal.SIGKILL)
        again = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=64, messages=ask)
        assert again.choices[0].message.content == first.choices[0].message.content
        _ends_cleanly(proc)
        assert "starting its worker again" in proc.stderr.read()
    finally:
        proc.kill()


@pytest.mark.parametrize("pieces, stops, text, hit", [
    (["Hello wor", "ld, and more"], ["world"], "Hello ", "world"),  # split across pieces
    (["a <", "|e", "nd|> b"], ["<|end|>"], "a ", "<|end|>"),
    (["a <", "b <|e", "x"], ["<|end|>"], "a <b <|ex", None),  # false starts are released
    (["no stop here"], ["zz", "q"], "no stop here", None),
    (["ab", "c"], ["bc", "abcd"], "a", "bc"),  # the first stop found in the text wins
])
def test_stop_text_holds_back_only_what_may_start_a_stop(pieces, stops, text, hit):
    from engine.runtime.decode.stops import StopText

    stop = StopText(stops)
    out = "".join(stop.push(p) for p in pieces) + stop.flush()
    assert (out, stop.hit) == (text, hit)


@pytest.mark.parametrize("stages", [1, 2])
def test_the_serve_benchmark_measures_both_servers(stages, tiny_models, tmp_path):
    """`fleet bench serve` in miniature: fleet serve and LLMPipeline behind the same API, one user;
    one stage is the whole model in this process (no worker)."""
    from engine.bench.serve import run_serve

    report = run_serve(str(tiny_models["llama"]), stages=stages, users=(1,), tokens=4, runs=1, weights="f32",
                       parts=("users",), out=tmp_path / "serve.json", log=lambda _: None)
    rows = {r["server"]: r for r in report["rows"]}
    assert set(rows) == {"fleet serve", "LLMPipeline"}
    assert all(r["requests"] == 1 and r["tok_s"] > 0 for r in rows.values()), rows
    assert "tok/s, fleet serve / LLMPipeline, 1 user(s)" in report["ratios"]


def test_parity_bench_in_miniature(tiny_models, tmp_path):
    """`fleet bench parity` in miniature, with the INT4-head row: every configuration decodes the
    same ids, and the report names each one."""
    from engine.bench.parity import run_parity

    report = run_parity(str(tiny_models["qwen2"]), tokens=4, warmup=0, runs=1, weights="int4", head="int4",
                        out=tmp_path / "parity.json", log=lambda _: None)
    rows = {r["config"]: r for r in report["rows"]}
    assert {"ours 1-stage", "ours 2-stage", "ours 1-stage, paged", "ours 1-stage, INT4 head",
            "LLMPipeline 1-stage"} <= set(rows)
    assert all(r["tok_s"] > 0 for r in rows.values()), rows
    assert report["settings"]["head"] == "int4"
