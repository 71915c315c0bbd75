"""The API's checks that come before a request reaches its route, cheapest first, so that a hostile
request costs the server as little as it can:

1. the Host header, on loopback: a loopback name (``localhost``, ``127.0.0.1``, ``[::1]``), else
   421 (a web page's DNS rebinding reaches a loopback API under its own host name);
2. the API key (``/v1`` and Ollama's ``/api``, when the server has one), as a bearer token or
   Anthropic's ``x-api-key`` header: 401 before a byte of the body is read;
3. the body's type: a POST's ``Content-Type`` must be ``application/json``, else 415 (a web page may
   send a body of another type, or of none, to a loopback API without the browser asking first,
   as it does before a JSON body: CORS's "simple requests");
4. the body's size: a ``Content-Length`` over the limit is 413 at once, and a chunked body is
   counted as it comes and refused with 413 once it passes the limit;
5. the body's nesting (JSON arrays and objects): past ``MAX_BODY_DEPTH``, 400 before it is parsed
   (Python's parser and every walk over the parsed body recurse).

A plain ASGI middleware (Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from
the route): it reads the body itself, bounded, and hands it on.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress

import numpy as np
from fastapi.responses import JSONResponse

from engine.serve.schema import ApiError

JSON = "application/json"
KEYED = ("/v1", "/api")  # the paths that need the API key (OpenAI's and Anthropic's, Ollama's)
DRAIN = 64 * 1024  # the most of a refused body read (and dropped) before the answer
MAX_BODY_DEPTH = 128  # nested arrays and objects in a request body (a schema in it: up to 64 more)
_STEP = np.zeros(256, np.int8)  # what a byte does to the nesting, outside strings
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port (``[::1]:8000``: ``[::1]``)."""
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def nesting(body: bytes) -> int:
    """How deep a JSON text's arrays and objects nest (brackets inside strings do not count), in a
    few vectorized passes: 4 MB in tens of milliseconds."""
    # escaped backslashes, then escaped quotes, out: every quote left opens or closes a string
    codes = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    steps = _STEP[codes]
    steps[(np.cumsum(codes == ord('"'), dtype=np.int32) & 1).astype(bool)] = 0
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def _may_nest_deep(body: bytes) -> bool:
    return body.count(b"[") + body.count(b"{") > MAX_BODY_DEPTH


async def _drained(receive, read: int, length: str | None) -> bool:
    """Reads and drops the rest of a refused body if its Content-Length says it is small (a client
    that sends it whole before reading the answer then gets the answer, not a reset connection);
    False for a larger or chunked body, which is not waited for, or when the client has gone."""
    if length is None or not length.strip().isdigit() or int(length) > DRAIN:
        return False
    while read <= DRAIN:
        message = await receive()
        if message["type"] == "http.disconnect":
            return False
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return read <= DRAIN
    return False


class RequestGuard:
    """The checks above, in front of ``app``: ``api_key`` None lets ``/v1`` and ``/api`` in without one,
    ``max_body`` in bytes, ``local`` the server listens on loopback (the Host check)."""

    def __init__(self, app, api_key: str | None, max_body: int, local: bool):
        self.app, self.api_key, self.max_body, self.local = app, api_key, max_body, local

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        error = self._refusal(scope["method"], scope["path"], headers)
        body, size, more = [], 0, True
        if error is None:
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client has gone: nobody reads an answer
                chunk, more = message.get("body", b""), message.get("more_body", False)
                size += len(chunk)
                if size > self.max_body:
                    error = self._too_large(f"the request body is over {self.max_body} bytes")
                    break
                body.append(chunk)
        if error is None:
            whole = b"".join(body)
            depth = await asyncio.to_thread(nesting, whole) if _may_nest_deep(whole) else 0
            if depth > MAX_BODY_DEPTH:
                error = ApiError(400, f"the request body nests {depth} levels of arrays and objects; at most "
                                      f"{MAX_BODY_DEPTH}", code="body_too_deep")
        if error is not None:
            answer = {}
            if more and not await _drained(receive, size, headers.get("content-length")):
                answer["Connection"] = "close"  # the unread rest is not waited for: the connection ends
            return await JSONResponse(error.body_for(scope["path"]), status_code=error.status,
                                      headers=answer)(scope, receive, send)
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # after the body: the client's disconnect, as the route expects

        await self.app(scope, replay, send)

    def _refusal(self, method: str, path: str, headers: dict[str, str]) -> ApiError | None:
        """What the request's line and headers alone refuse it for, or None."""
        if self.local and not is_loopback(host_name(headers.get("host", ""))):
            return ApiError(421, f"this server listens on loopback and answers only to localhost, 127.0.0.1 or "
                                 f"[::1], not the Host {headers.get('host', '(none)')!r} (a guard against DNS "
                                 "rebinding)", code="invalid_host")
        if self.api_key and any(path == p or path.startswith(p + "/") for p in KEYED):
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode("latin-1"), self.api_key.encode()):
                why = "a wrong API key" if token else "no API key"
                return ApiError(401, f"this server needs its API key as a bearer token (or an x-api-key header); "
                                     f"the request carries {why}", code="invalid_api_key")
        given = headers.get("content-type")
        if method == "POST" and (given or "").split(";")[0].strip().lower() != JSON:
            sent = f"the Content-Type {given!r}" if given else "no Content-Type"
            return ApiError(415, f"the request body must be JSON sent with the header Content-Type: {JSON}; this "
                                 f"request has {sent}", code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            return self._too_large(f"the request body is {int(length)} bytes")
        return None

    def _too_large(self, what: str) -> ApiError:
        return ApiError(413, f"{what}; this server takes at most {self.max_body} bytes (the setting "
                             f"api_max_body_mb)", code="body_too_large")
