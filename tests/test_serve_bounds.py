"""The API's bounds on hostile requests (``engine.serve.guard`` and the schema limits): the API key
is checked before a byte of the body is read, a body over ``api_max_body_mb`` is 413 (by its
Content-Length or as a chunked body comes), on loopback only loopback Host names are answered (DNS
rebinding), a large schema compiles off the event loop, and schemas or bodies nested too deep are
400s, never 500s."""

from __future__ import annotations

import http.client
import json
import socket
import threading

import pytest

from engine.config import Scheduling
from engine.runtime.decode import grammar
from engine.runtime.decode.service import ChatService
from engine.runtime.stages.chain import LocalChain
from engine.serve import schema
from engine.serve.server import ApiServer

MODEL = "tiny"
KEY = "fs-test-key-0123456789"
WAIT_S = 60  # a hang guard only: every exchange below answers at once when the server is right


@pytest.fixture(scope="module")
def service(tiny_exports):
    service = ChatService(LocalChain(tiny_exports["qwen2", "1"].folders), scheduling=Scheduling(streams=2),
                          max_length=64)
    yield service
    service.close()


@pytest.fixture(scope="module")
def server(service):
    server = ApiServer(service, port=0, model_id=MODEL, max_body_mb=0.5).start()
    yield server
    server.stop()


def _request(server, method, path, body=b"", headers=None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=WAIT_S)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def _head(server, length: int | None, headers: dict | None = None) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", f"Host: 127.0.0.1:{server.port}",
             "Content-Type: application/json",
             f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _answer(sock: socket.socket) -> tuple[int, dict]:
    """The response on a raw connection (the server may close it once it has answered)."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length")]
        if length and len(body) >= length[0]:
            break
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


ASK = [{"role": "user", "content": "hi"}]
BODIES = {  # a small request to each API
    "/v1/chat/completions": {"model": MODEL, "messages": ASK, "max_tokens": 2},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": MODEL, "messages": ASK, "max_tokens": 2},
    "/api/chat": {"model": MODEL, "messages": ASK, "stream": False, "options": {"num_predict": 2}},
}


def _schema_format(value) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}


def test_the_api_key_is_checked_before_the_body_is_read(service):
    """The security review's case: an unauthenticated 6 MB malformed body was parsed (a 400) before
    the key was checked.  Here only 128 KB of it is sent: the 401 comes without the rest."""
    server = ApiServer(service, port=0, api_key=KEY, model_id=MODEL).start()
    try:
        for auth in ({}, {"Authorization": "Bearer wrong-key"}):
            with socket.create_connection((server.host, server.port), timeout=WAIT_S) as sock:
                sock.sendall(_head(server, 6_000_000, auth) + b"{not json" * (128 * 1024 // 9))
                status, doc = _answer(sock)
            assert status == 401 and doc["error"]["code"] == "invalid_api_key"
        # a small, valid body without the key: 401 as well, and the connection stays usable
        conn = http.client.HTTPConnection(server.host, server.port, timeout=WAIT_S)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(_chat()), {"Content-Type": "application/json"})
            refused = conn.getresponse()
            refused.read()
            assert refused.status == 401 and refused.getheader("Connection") != "close"
            conn.request("POST", "/v1/chat/completions", json.dumps(_chat()),
                         {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["choices"]
        finally:
            conn.close()
    finally:
        server.stop()


def test_a_body_over_the_limit_is_413(server):
    # by its Content-Length, with only a part of it sent
    with socket.create_connection((server.host, server.port), timeout=WAIT_S) as sock:
        sock.sendall(_head(server, 1 << 20) + b" " * 1024)
        status, doc = _answer(sock)
    assert status == 413 and doc["error"]["code"] == "body_too_large"
    assert "api_max_body_mb" in doc["error"]["message"] and str(1 << 20) in doc["error"]["message"]
    # chunked (no Content-Length): counted as it comes
    with socket.create_connection((server.host, server.port), timeout=WAIT_S) as sock:
        sock.sendall(_head(server, None))
        try:
            for _ in range(64):  # 1 MB in 16 KB chunks, unless the server answers and closes first
                sock.sendall(b"4000\r\n" + b" " * 0x4000 + b"\r\n")
        except OSError:
            pass
        status, doc = _answer(sock)
    assert status == 413 and "over 524288 bytes" in doc["error"]["message"]
    # under the limit, a body is read and parsed as before (a prompt too long for the model)
    status, doc = _request(server, "POST", "/v1/chat/completions",
                           json.dumps(_chat(messages=[{"role": "user", "content": "word " * 40000}])))
    assert status == 400 and doc["error"]["code"] == "context_length_exceeded"


def test_on_loopback_only_loopback_host_names_are_answered(server):
    for host in ("evil.example", f"evil.example:{server.port}", "10.0.0.1", "localhost.evil.example"):
        status, doc = _request(server, "GET", "/health", headers={"Host": host})
        assert status == 421 and doc["error"]["code"] == "invalid_host", host
        status, doc = _request(server, "POST", "/v1/chat/completions", json.dumps(_chat()), {"Host": host})
        assert status == 421, host
    for host in (f"localhost:{server.port}", "localhost", f"127.0.0.1:{server.port}", f"[::1]:{server.port}"):
        assert _request(server, "GET", "/health", headers={"Host": host})[0] == 200, host
    assert _request(server, "GET", "/v1/models", headers={"Host": f"localhost:{server.port}"})[0] == 200


def test_off_loopback_the_key_guards_and_any_host_is_answered(service):
    server = ApiServer(service, host="0.0.0.0", port=0, api_key=KEY, model_id=MODEL).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
        conn.request("GET", "/v1/models", headers={"Host": "fleet.example", "Authorization": f"Bearer {KEY}"})
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        server.stop()


def test_a_large_schema_is_checked_while_the_api_keeps_answering(server, monkeypatch):
    """The security review's 10,000-property schema held the event loop while it compiled; here its
    compile waits until /health has answered (an event), which it never could on the event loop.
    Then it is refused: that many optional properties break llguidance's parser at the reply's
    first token (a 503 before this bound)."""
    compiling, answered = threading.Event(), threading.Event()
    real = schema.compile_grammar

    def compile_after_health(*args, **kwargs):
        compiling.set()
        answered.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(schema, "compile_grammar", compile_after_health)
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    result = []
    thread = threading.Thread(target=lambda: result.append(_request(
        server, "POST", "/v1/chat/completions", json.dumps(_chat(response_format=_schema_format(huge))))))
    thread.start()
    assert compiling.wait(WAIT_S)
    try:
        status, doc = _request(server, "GET", "/health")
    except TimeoutError:
        status = None  # the event loop was held by the compile
    answered.set()
    assert status == 200, "the API did not answer while a schema compiled"
    thread.join(WAIT_S)
    assert result and result[0][0] == 400, result
    error = result[0][1]["error"]
    assert error["param"] == "response_format.json_schema.schema" and "10000 optional properties" in error["message"]


@pytest.mark.parametrize("levels", [100, 900])
def test_a_schema_nested_too_deep_is_a_400_naming_its_field(server, levels):
    deep = {"type": "string"}
    for _ in range(levels):
        deep = {"type": "array", "items": deep}
    status, doc = _request(server, "POST", "/v1/chat/completions",
                           json.dumps(_chat(response_format=_schema_format(deep))))
    assert status == 400, doc
    if levels < 128:  # within the body's own bound: the schema's names its field
        assert doc["error"]["param"] == "response_format.json_schema.schema"
        assert f"more than {grammar.MAX_SCHEMA_DEPTH} levels" in doc["error"]["message"]
    else:
        assert doc["error"]["code"] == "body_too_deep"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                         "properties": {"a": deep}}}}
    status, doc = _request(server, "POST", "/v1/chat/completions", json.dumps(_chat(tools=[tool])))
    assert status == 400, doc
    if levels < 128:
        assert doc["error"]["param"] == "tools[0].function.parameters"


def test_a_schema_too_large_is_a_400_naming_its_field(service):
    server = ApiServer(service, port=0, model_id=MODEL).start()  # the default body limit: room for the schema
    try:
        names = [f"property{i}" for i in range(20_000)]
        huge = {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}
        assert len(json.dumps(huge)) > grammar.MAX_SCHEMA_CHARS
        status, doc = _request(server, "POST", "/v1/chat/completions",
                               json.dumps(_chat(response_format=_schema_format(huge))))
        assert status == 400 and doc["error"]["param"] == "response_format.json_schema.schema"
        assert f"at most {grammar.MAX_SCHEMA_CHARS}" in doc["error"]["message"]
    finally:
        server.stop()


def test_a_deep_json_body_is_a_400(server):
    deep_field = json.dumps(_chat(messages=[{"role": "user", "content": "x"}])).replace('"x"', "[" * 500 + "]" * 500)
    for body in (b"[" * 100_000 + b"]" * 100_000, deep_field.encode()):
        status, doc = _request(server, "POST", "/v1/chat/completions", body)
        assert status == 400 and doc["error"]["code"] == "body_too_deep", doc
        assert "levels of arrays and objects" in doc["error"]["message"]
    # brackets inside strings do not nest
    status, doc = _request(server, "POST", "/v1/chat/completions",
                           json.dumps(_chat(messages=[{"role": "user", "content": "[" * 1000}])))
    assert status != 400 or doc["error"]["code"] != "body_too_deep"


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before it closed the connection, or None when it is still open after ``seconds``."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def test_half_sent_requests_cannot_take_the_server_from_others(service):
    """The security review's case: 220 half-sent requests left /health unanswered (its process had
    200 file descriptors).  Here one client (127.0.0.2) opens more than its cap: the extra ones are
    refused at once, /health answers another client at once, and the half-sent heads are cut at the
    head deadline."""
    cap, deadline = 4, 0.5
    server = ApiServer(service, port=0, model_id=MODEL, head_deadline_s=deadline,
                       max_connections_per_client=cap).start()
    socks = []
    try:
        for _ in range(cap + 3):
            sock = socket.create_connection((server.host, server.port), timeout=WAIT_S, source_address=("127.0.0.2", 0))
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode())  # no blank line
            socks.append(sock)
        refused = [_closed_within(sock, 0.2) for sock in socks[cap:]]
        assert all(r is not None and r.startswith(b"HTTP/1.1 429") for r in refused), refused
        assert b"at most 4" in refused[0] and b"Retry-After: 1" in refused[0]
        conn = http.client.HTTPConnection(server.host, server.port, timeout=1.0)  # from 127.0.0.1
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        for sock in socks[:cap]:
            answer = _closed_within(sock, deadline + 2.0)
            assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        # the cut connections no longer count: the client's next request is answered
        conn = http.client.HTTPConnection(server.host, server.port, timeout=WAIT_S, source_address=("127.0.0.2", 0))
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def test_a_head_sent_in_time_is_served_on_a_kept_connection(service):
    server = ApiServer(service, port=0, model_id=MODEL, head_deadline_s=0.3).start()
    try:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=WAIT_S)
        for _ in range(2):  # the second request on the same connection, after longer than the head deadline
            conn.request("GET", "/health")
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["status"] == "ok"
            threading.Event().wait(0.5)
        conn.close()
    finally:
        server.stop()


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat"])
def test_a_body_not_sent_as_json_is_415(server, path, content_type):
    """A web page may post a body of these types (or of none) to a loopback API without the
    browser asking the API first (CORS's simple requests): refused before it is read."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=WAIT_S)
    try:
        conn.putrequest("POST", path)
        body = json.dumps(BODIES[path]).encode()
        conn.putheader("Content-Length", str(len(body)))
        if content_type:
            conn.putheader("Content-Type", content_type)
        conn.endheaders(body)
        response = conn.getresponse()
        doc = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 415, doc
    message = doc["error"] if path.startswith("/api/") else doc["error"]["message"]
    assert "Content-Type: application/json" in message
    assert (repr(content_type) if content_type else "no Content-Type") in message
    # the same body as JSON is served
    status, _ = _request(server, "POST", path, json.dumps(BODIES[path]),
                         {"Content-Type": "application/json; charset=utf-8"})
    assert status == 200


def test_more_requests_waiting_than_the_limit_are_429_with_retry_after(tiny_exports):
    """One stream, held by a reply whose text callback waits (the scheduler waits with it), and one
    request queued behind it: with ``max_waiting`` 1 the next API request is refused at once."""
    service = ChatService(LocalChain(tiny_exports["qwen2", "1"].folders), scheduling=Scheduling(streams=1),
                          max_length=64)
    server = ApiServer(service, port=0, model_id=MODEL, max_waiting=1).start()
    holding, release = threading.Event(), threading.Event()

    def hold(_piece, _tokens):
        holding.set()
        release.wait(WAIT_S)

    ask = [{"role": "user", "content": "hi"}]
    handles = [service.submit(ask, 32, on_text=hold, ignore_eos=True)]
    try:
        assert holding.wait(WAIT_S)
        handles.append(service.submit(ask, 2))
        assert service.queued == 1
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/api/chat"):
            conn = http.client.HTTPConnection(server.host, server.port, timeout=WAIT_S)
            conn.request("POST", path, json.dumps(BODIES[path]), {"Content-Type": "application/json"})
            response = conn.getresponse()
            doc = json.loads(response.read())
            conn.close()
            assert response.status == 429, (path, doc)
            assert response.getheader("Retry-After") == "2"
            assert "requests waiting for one: 1, at most 1 (the setting api_max_waiting)" in json.dumps(doc), doc
        assert service.queued == 1  # nothing refused was queued
    finally:
        release.set()
        for handle in handles:
            handle.cancel()
        server.stop()
        service.close()
