"""Connection-level defences under uvicorn, and the signal handling of `ridgefill serve`.

uvicorn (0.54, h11) closes an idle keep-alive connection after `timeout_keep_alive`, but has
no timeout for a fresh connection that never sends a whole request head, and no cap on open
connections: idle sockets pile up until accept() fails with EMFILE. So:

- GuardedH11Protocol arms a header timer when a connection opens (and when the first byte of
  a later request arrives) and closes the connection if no full request head came in time.
- ConnectionGuard caps open connections. At the cap, a new connection evicts the oldest one
  still waiting for a request head (idle), else the oldest one still sending its request body
  (slow): neither holds a request the server could run. Only when every connection is running a
  request does the new one go to a small reserve that serves /health alone (so a supervisor
  always gets an answer), and past that reserve it is refused with 503. A flood of idle or
  trickling sockets then cannot lock out /health or real clients.
- RateLimitedLog keeps one line per kind of per-connection error (no traceback storms).
- DrainingServer: the first SIGTERM/SIGINT starts the drain and the process exits 0;
  a second one forces the exit. It keeps listening while the engine drains, so a client that
  connects then gets /health's "draining" (and 503s), not a refused connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import resource
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

log = logging.getLogger("ridgefill.server")

LISTEN_BACKLOG = 128  # also the most connections asyncio accepts in one go
# NOTE: asyncio accepts up to LISTEN_BACKLOG connections per wake-up before any of them
# reaches ConnectionGuard, and two or three wake-ups can pass first; keep room for that on top
# of the files the model, logs and listening socket hold.
FD_RESERVE = 128 + 3 * LISTEN_BACKLOG
SHUTDOWN_BACKSTOP_S = 3.0  # past the grace: cancel request tasks that still did not end


HEALTH_RESERVE = 4  # connections past the cap, each for one /health request, when none can be evicted
HEALTH_PATH = b"/health"
MAX_REQUEST_LINE = 8192  # a reserve connection's request line must fit in this to be read


class ConnectionGuard:
    """Open connections of one server, oldest first (a dict keeps insertion order), and the
    /health-only reserve beyond them."""

    def __init__(self, cap: int, reserve: int = HEALTH_RESERVE):
        self.cap, self.reserve = cap, reserve
        self._open: dict[GuardedH11Protocol, None] = {}
        self._reserved: dict[GuardedH11Protocol, None] = {}
        self.evicted = self.refused = self.reserve_admitted = 0  # counts, for scripts/reliability/slow_clients.py

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """True: `conn` may stay (conn.health_only says whether only for /health)."""
        if len(self._open) >= self.cap and not self._evict_one():
            if len(self._reserved) >= self.reserve:
                self.refused += 1
                _limited("connection refused: all %d connections are busy (server.max_connections)", self.cap)
                return False
            self.reserve_admitted += 1
            conn.health_only = True
            self._reserved[conn] = None
            return True
        self._open[conn] = None
        return True

    def _evict_one(self) -> bool:
        """Close the oldest connection holding no runnable request: idle ones first, then ones
        still sending a body. False when every connection is running a request."""
        victim = next((c for c in self._open if c.awaiting_request()), None)
        kind = "idle"
        if victim is None:
            victim, kind = next((c for c in self._open if c.sending_body()), None), "still-sending"
        if victim is None:
            return False
        self.evicted += 1
        _limited("closed the oldest %s connection: %d connections open (server.max_connections)", kind, self.cap)
        self.release(victim)
        victim.transport.close()
        return True

    def release(self, conn: GuardedH11Protocol) -> None:
        self._open.pop(conn, None)
        self._reserved.pop(conn, None)

    def __len__(self) -> int:
        return len(self._open) + len(self._reserved)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout and the connection cap."""

    def __init__(self, *args, guard: ConnectionGuard, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._guard, self._header_timeout_s = guard, header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self.health_only = False  # set by the guard: admitted to the reserve, for one /health request
        self._request_line: bytearray | None = bytearray()  # a reserve connection's bytes, held until its path is known

    def awaiting_request(self) -> bool:
        """No request in progress: idle, or its request head has not fully arrived."""
        return self.cycle is None or self.cycle.response_complete

    def sending_body(self) -> bool:
        """A request head arrived and its body is still coming: nothing the server can run yet."""
        return not self.awaiting_request() and self.conn.their_state is h11.SEND_BODY

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        _send_at_once(transport)
        if not self._guard.admit(self):
            transport.write(_refusal(self._guard.cap))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.health_only:
            data = self._health_request_only(data)
            if not data:
                return
        if self.awaiting_request() and self._header_timer is None:
            self._arm_header_timer()  # first byte of a request on a kept-alive connection
        super().data_received(data)
        if not self.awaiting_request():
            self._cancel_header_timer()

    def _health_request_only(self, data: bytes) -> bytes:
        """A reserve connection's data for h11 once its request line names /health; b"" while the
        line is incomplete; a 503 and the close for any other path. Checked before h11 parses
        it, so no other request ever reaches the app through the reserve."""
        if self._request_line is None:
            return data  # the line was checked already
        self._request_line += data
        line, newline, _ = bytes(self._request_line).partition(b"\n")
        if not newline:
            if len(self._request_line) > MAX_REQUEST_LINE:
                self._refuse()
            return b""
        target = line.split(b" ")[1] if line.count(b" ") >= 2 else b""
        if target.split(b"?")[0] != HEALTH_PATH:
            self._refuse()
            return b""
        held, self._request_line = bytes(self._request_line), None
        return held

    def _refuse(self) -> None:
        self._guard.refused += 1
        self.transport.write(_refusal(self._guard.cap))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.health_only:
            self.transport.close()  # NOTE: one answer per reserve slot; the slot frees for the next probe
            return
        if self.awaiting_request() and self.conn.trailing_data[0]:
            self._arm_header_timer()  # part of a pipelined request is already buffered

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self._header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.awaiting_request() and not self.transport.is_closing():
            # NOTE: closed without a 408: h11 cannot answer a request it has not parsed, and
            # a client that sent nothing reads nothing anyway.
            self.transport.close()


def _send_at_once(transport) -> None:
    """TCP_NODELAY on the connection. h11 writes a response's head and body as two segments; with
    Nagle's algorithm on, the body waits for the client to acknowledge the head, which a client
    delays up to 40 ms: every request after the first on a keep-alive connection took 44 ms, even
    /health. asyncio sets the option only on sockets whose proto is IPPROTO_TCP, and an accepted
    socket's proto is its listening socket's (0 for ours and for uvicorn's own)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _refusal(cap: int) -> bytes:
    body = json.dumps(error_body(503, f"too many open connections (the server allows {cap})")).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


# -- logging --------------------------------------------------------------------------------


class RateLimitedLog(logging.Filter):
    """At most one warning or error per (logger, message) per `window_s`; the next one says
    how many were dropped. Tracebacks: the first of a kind only (`first_traceback`), or none.
    Per-connection errors (accept failures, malformed requests, refused connections) then
    cost a line, not a log flood."""

    def __init__(self, window_s: float = 10.0, first_traceback: bool = True):
        super().__init__()
        self.window_s, self.first_traceback = window_s, first_traceback
        self._last: dict[tuple[str, str], float] = {}
        self._dropped: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:  # lifecycle lines (started, shutting down) pass
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            seen = key in self._last
            if seen and now - self._last[key] < self.window_s:
                self._dropped[key] = self._dropped.get(key, 0) + 1
                return False
            self._last[key] = now
            dropped = self._dropped.pop(key, 0)
        cancelled = bool(record.exc_info) and isinstance(record.exc_info[1], asyncio.CancelledError)
        # NOTE: a CancelledError is a request task cut at the end of the shutdown grace: expected.
        if record.exc_info and (seen or cancelled or not self.first_traceback):
            exc = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})"
            record.args, record.exc_info, record.exc_text = None, None, None
        if dropped:
            record.msg = f"{record.getMessage()} [{dropped} more like this in the last {self.window_s:.0f} s]"
            record.args = None
        return True


_LIMITER = RateLimitedLog()
# NOTE: asyncio's accept() errors (EMFILE) carry a traceback that says nothing new.
_ASYNCIO_LIMITER = RateLimitedLog(first_traceback=False)
_limited_log = logging.getLogger("ridgefill.connections")
_limited_log.addFilter(_LIMITER)


def _limited(message: str, *args) -> None:
    _limited_log.warning(message, *args)


def quiet_connection_errors() -> None:
    """Rate-limit the loggers that report one record per bad connection: asyncio (accept()
    failures, with a traceback each) and uvicorn.error (malformed requests, app errors)."""
    for name, limiter in (("asyncio", _ASYNCIO_LIMITER), ("uvicorn.error", _LIMITER)):
        logger = logging.getLogger(name)
        if limiter not in logger.filters:
            logger.addFilter(limiter)


# -- open files -------------------------------------------------------------------------------


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap(configured: int, open_files: int) -> int:
    """server.max_connections, lowered to stay below the open-files limit (each connection
    is one file, the /health reserve included), so accept() never fails with EMFILE."""
    fits = max(open_files - FD_RESERVE - HEALTH_RESERVE, 1)
    if configured > fits:
        log.warning(
            "server.max_connections %d lowered to %d to fit the open-files limit %d", configured, fits, open_files
        )
    return min(configured, fits)


# -- uvicorn ----------------------------------------------------------------------------------


def uvicorn_config(
    app, server_config, max_connections: int, log_level: str = "info", host: str = "127.0.0.1", port: int = 0
) -> uvicorn.Config:
    """The uvicorn settings every ridgefill server runs with (serve and BackgroundServer);
    host and port matter only when uvicorn binds the socket itself (not given `sockets`)."""
    guard = ConnectionGuard(max_connections)
    protocol = functools.partial(GuardedH11Protocol, guard=guard, header_timeout_s=server_config.header_timeout_s)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        lifespan="on",
        log_level=log_level,
        backlog=LISTEN_BACKLOG,
        access_log=False,  # NOTE: ridgefill_server.access writes one structured line per request instead
        timeout_keep_alive=server_config.keep_alive_s,
        # NOTE: the engine aborts what is left at the grace; this backstop cancels request
        # tasks that still hang after it (a client that stopped reading its stream).
        timeout_graceful_shutdown=server_config.shutdown_grace_s + SHUTDOWN_BACKSTOP_S,
    )
    config.connection_guard = guard  # for tests and scripts that report evictions
    return config


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT calls `on_signal` (stop admission, start the
    drain) and whose exit status stays 0. uvicorn itself re-raises the caught signal after
    shutting down, so a SIGTERM'd server would die by that signal (status 143)."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_signal: Callable[[], None],
        drained: Callable[[], Awaitable[None]] | None = None,
    ):
        """`drained`: returns once the drain is over (bounded by the grace and its backstop)."""
        super().__init__(config)
        self._on_signal = on_signal
        self._drained = drained

    async def shutdown(self, sockets=None) -> None:
        # NOTE: uvicorn's shutdown closes the listening sockets first; until the drain ends, new
        # connections are still accepted, so /health on them says "draining" (issue 31, finding 5).
        if self._drained is not None and not self.force_exit:
            drain = asyncio.ensure_future(self._drained())
            while not drain.done() and not self.force_exit:  # a second signal stops waiting
                await asyncio.wait({drain}, timeout=0.1)
            if not drain.done():
                drain.cancel()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            log.warning("second %s: exiting without waiting for running requests", signal.Signals(sig).name)
            self.force_exit = True
            return
        self.should_exit = True
        log.info("%s: no new requests; draining the running ones", signal.Signals(sig).name)
        self._on_signal()
