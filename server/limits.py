"""ASGI middleware: refuse request bodies over a size limit with 413, before parsing them,
bodies that stall with 408, and clients over their request rate with 429."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable

from starlette.exceptions import HTTPException

from .access import send_json_error
from .errors import error_body


def _too_large(max_bytes: int) -> str:
    return f"request body exceeds the limit of {max_bytes} bytes"


class _TooLarge(HTTPException):
    """Raised from the app's receive once a body outgrows the limit. An HTTPException because
    FastAPI's body reader re-raises those but turns any other error into a 400 ("error parsing
    the body"); the app's HTTPException handler then answers 413."""

    def __init__(self, max_bytes: int):
        super().__init__(413, _too_large(max_bytes))


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0
        started = False

        async def limited_receive():
            # NOTE: chunked bodies have no Content-Length; count what actually arrives.
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(error_body(413, _too_large(self.max_bytes))).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class BodyReadTimeout:
    """408 when a request body stalls or trickles: each part of the body must arrive within
    timeout_s (server.body_timeout_s), and the whole body within deadline_s of the request head
    (server.body_deadline_s). Without the first, a client that declares more bytes than it sends
    holds its request (and its connection) open forever; without the second, one that sends a byte
    just inside each part's timeout does the same. Once `draining()` is true (shutdown), a body
    still awaited gets 503 at once instead, so it cannot hold up the exit. The answer goes out from
    here, with Connection: close; the app then sees a disconnect, and whatever it answers is dropped."""

    POLL_S = 0.25  # how often a wait for the body looks at draining()

    def __init__(self, app, timeout_s: float, deadline_s: float, draining: Callable[[], bool] = lambda: False):
        self.app, self.timeout_s, self.deadline_s, self.draining = app, timeout_s, deadline_s, draining

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body_done = answered = started = False
        whole_body_by = time.monotonic() + self.deadline_s  # NOTE: the head has arrived: the clock starts now

        async def timed_receive():
            nonlocal body_done, answered
            if answered:
                return {"type": "http.disconnect"}
            if body_done:  # NOTE: later receives wait for a disconnect; they must not time out
                return await receive()
            message, missed = await self._next_part(receive, whole_body_by)
            if message is None:
                answered = True
                if not started:
                    await self._refuse(send, missed)
                return {"type": "http.disconnect"}
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message):
            nonlocal started
            if answered:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, timed_receive, guarded_send)

    async def _next_part(self, receive, whole_body_by: float):
        """(the next receive() message, None), or (None, the limit it missed: "part" or
        "whole") past a timeout, or (None, "draining") once draining."""
        part_by = time.monotonic() + self.timeout_s
        deadline, limit = (part_by, "part") if part_by <= whole_body_by else (whole_body_by, "whole")
        while not self.draining():
            left = deadline - time.monotonic()
            if left <= 0:
                return None, limit
            try:
                # NOTE: cancelling uvicorn's receive() mid-wait loses nothing; wait_for returns
                # a message that arrives while it cancels.
                return await asyncio.wait_for(receive(), min(left, self.POLL_S)), None
            except TimeoutError:
                continue
        return None, "draining"

    async def _refuse(self, send, missed: str | None):
        if missed == "draining":
            await send_json_error(send, 503, "the server is shutting down", close=True)
            return
        if missed == "whole":
            why = f"the whole request body did not arrive within {self.deadline_s:g} s (server.body_deadline_s)"
        else:
            why = f"the request body did not arrive within {self.timeout_s:g} s (server.body_timeout_s)"
        await send_json_error(send, 408, why, close=True)


class RateLimit:
    """Per client address, at most `per_minute` requests to the generation routes (a token
    bucket refilled continuously, so a burst of `per_minute` passes, then one every 60/per_minute
    seconds); the rest get 429 with Retry-After. 0 turns it off. In-process state: one server."""

    LIMITED = ("/v1/completions", "/v1/chat/completions")
    MAX_CLIENTS = 10_000  # buckets kept; beyond this the full ones are dropped (they hold no debt)

    def __init__(self, app, per_minute: int):
        self.app, self.per_minute = app, per_minute
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, last update)

    async def __call__(self, scope, receive, send):
        if self.per_minute and scope["type"] == "http" and scope.get("path") in self.LIMITED:
            wait = self._take((scope.get("client") or ("?",))[0], time.monotonic())
            if wait > 0:
                return await send_json_error(
                    send,
                    429,
                    f"rate limit: {self.per_minute} requests a minute per client "
                    f"(server.rate_limit_per_minute); retry in {wait:.1f} s",
                    headers={"retry-after": str(math.ceil(wait))},
                )
        await self.app(scope, receive, send)

    def _take(self, client: str, now: float) -> float:
        """Take one token for `client`; 0 when it had one, else the seconds until it will."""
        rate = self.per_minute / 60.0
        tokens, last = self._buckets.get(client, (float(self.per_minute), now))
        tokens = min(float(self.per_minute), tokens + (now - last) * rate)
        if tokens < 1:
            self._buckets[client] = (tokens, now)
            return (1 - tokens) / rate
        self._buckets[client] = (tokens - 1, now)
        if len(self._buckets) > self.MAX_CLIENTS:
            self._forget_full(now)
        return 0.0

    def _forget_full(self, now: float) -> None:
        rate = self.per_minute / 60.0
        self._buckets = {
            c: (t, last) for c, (t, last) in self._buckets.items() if t + (now - last) * rate < self.per_minute
        }
