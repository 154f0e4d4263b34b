"""Per-request plumbing outside the routes: request ids, the access log, the Host allow-list,
and the helpers routes call (note_usage, deadline_for).

Routes talk to the access log through `request.state` (Starlette keeps it in scope["state"],
which this middleware reads once the response is done).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable

from fastapi import Request

from .errors import HTTPError, error_body

log = logging.getLogger("ridgefill.access")

MAX_REQUEST_ID = 128
_ID_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {'"', "\\"}  # visible ASCII, log-safe


# -- helpers for routes -------------------------------------------------------------------------


def note_usage(request: Request, prompt_tokens: int | None, completion_tokens: int | None = None) -> None:
    """Token counts for this request's access log line; call it whenever they are known (a
    streaming route may call it again at the end of the stream: the last call wins)."""
    request.state.prompt_tokens = prompt_tokens
    request.state.completion_tokens = completion_tokens


def deadline_for(request_timeout: float | None, cap_s: float) -> float:
    """The monotonic deadline of a request: its own `timeout` (seconds) if it gave one, never
    later than the server-wide cap (server.request_timeout_s)."""
    if request_timeout is not None and not request_timeout > 0:
        raise HTTPError(400, f"timeout must be a positive number of seconds, got {request_timeout}", "timeout")
    seconds = cap_s if request_timeout is None else min(request_timeout, cap_s)
    return time.monotonic() + seconds


def request_id_of(request: Request) -> str:
    return request.state.request_id


def clean_request_id(given: bytes | None) -> str:
    """The client's x-request-id when it is short visible ASCII, else a fresh one: a client
    must not be able to forge log lines or headers through it."""
    if given:
        text = given.decode("latin-1")
        if len(text) <= MAX_REQUEST_ID and all(c in _ID_CHARS for c in text):
            return text
    return uuid.uuid4().hex


# -- middleware -----------------------------------------------------------------------------------


class RequestContext:
    """Outermost middleware: gives each request an id (scope["state"]["request_id"], echoed in
    the x-request-id response header and in JSON error bodies as "request_id"), and writes one
    access log line when the response is done. `on_done(route, status)` feeds metrics."""

    def __init__(self, app, on_done: Callable[[str, int], None] | None = None):
        self.app, self.on_done = app, on_done

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        state = scope.setdefault("state", {})
        rid = state["request_id"] = clean_request_id(_header(scope, b"x-request-id"))
        reply = _Reply(send, rid)
        try:
            await self.app(scope, receive, reply.send)
        except BaseException:
            reply.status = reply.status or 500  # uvicorn answers 500 for what escapes the app
            raise
        finally:
            self._log(scope, state, reply.status, time.monotonic() - started)

    def _log(self, scope, state: dict, status: int | None, seconds: float) -> None:
        endpoint = scope.get("endpoint")
        route = getattr(endpoint, "__name__", "unmatched")
        fields = {
            "request_id": state.get("request_id"),
            "method": scope.get("method"),
            "path": scope.get("path"),
            "status": status or "-",
            "duration_ms": round(seconds * 1000, 1),
        }
        for name in ("prompt_tokens", "completion_tokens"):
            if state.get(name) is not None:
                fields[name] = state[name]
        client = scope.get("client")
        if client:
            fields["client"] = f"{client[0]}:{client[1]}"
        log.info(" ".join(f"{k}={_logfmt(v)}" for k, v in fields.items()), extra={"access": fields})
        if self.on_done is not None:
            self.on_done(route, status or 0)


class _Reply:
    """The send side of one request: adds x-request-id; holds a JSON error response until its
    body is complete, to add "request_id" to it and fix its content-length."""

    def __init__(self, send, rid: str):
        self._send, self.rid = send, rid
        self.status: int | None = None
        self._held: dict | None = None
        self._parts: list[bytes] = []

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            headers = [*message.get("headers", []), (b"x-request-id", self.rid.encode())]
            message = {**message, "headers": headers}
            if self.status >= 400 and (b"content-type", b"application/json") in headers:
                self._held = message
                return
        elif message["type"] == "http.response.body" and self._held is not None:
            self._parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _with_request_id(b"".join(self._parts), self.rid)
            headers = [(k, v) for k, v in self._held["headers"] if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            start, self._held = {**self._held, "headers": headers}, None
            await self._send(start)
            message = {"type": "http.response.body", "body": body}
        await self._send(message)


def _with_request_id(body: bytes, rid: str) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        doc["request_id"] = rid
        return json.dumps(doc).encode()
    return body


class HostAllowList:
    """Refuse requests whose Host header names no allowed host (421): a page on another
    origin that rebinds its DNS name to 127.0.0.1 still sends its own name as Host.
    Patterns: "*" (any), an exact name, "*.example.com" (any subdomain). A request without a
    Host header (HTTP/1.0) passes: browsers always send one."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app = app
        self.any = "*" in allowed
        self.exact = {h for h in allowed if not h.startswith("*.")}
        self.suffixes = tuple(h[1:] for h in allowed if h.startswith("*."))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        given = _header(scope, b"host")
        if given is None or self.allows(host_name(given.decode("latin-1"))):
            return await self.app(scope, receive, send)
        await send_json_error(
            send, 421, f"host {given.decode('latin-1')!r} is not served here (server.allowed_hosts)", close=True
        )

    def allows(self, name: str) -> bool:
        return name in self.exact or (bool(self.suffixes) and name.endswith(self.suffixes))


def host_name(host: str) -> str:
    """ "Example.com:8000" -> "example.com"; "[::1]:8000" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


async def send_json_error(
    send, status: int, message: str, close: bool = False, headers: dict[str, str] | None = None
) -> None:
    """An OpenAI-style error response sent straight from a middleware."""
    body = json.dumps(error_body(status, message)).encode()
    extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value
    return None


def _logfmt(value) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\\') or not text.isprintable()) else text
