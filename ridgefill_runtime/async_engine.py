"""The Engine behind an asyncio server: one background thread runs the step loop.

Requests come in through a thread-safe inbox; each request's token deltas go out to its own
asyncio.Queue through `loop.call_soon_threadsafe`, so the event loop never runs model code
and the engine thread never touches asyncio objects directly.

Fault policy: when a step raises, the sequences that were running are retried one at a time;
a sequence whose solo step raises again is the culprit and fails alone ("error"), the others
keep their progress. This costs one extra step per running sequence, only after a failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .config import RowsConfig
from .engine import Engine
from .errors import RidgefillError
from .sequence import SamplingParams, Sequence, SeqStatus

log = logging.getLogger("ridgefill.engine")


class EngineOverloaded(RidgefillError):
    """Too many requests are queued; the HTTP layer answers 503 with Retry-After."""


class EngineStopped(RidgefillError):
    """The engine thread is not running (shut down or not started)."""


@dataclass
class StreamEvent:
    """One message from the engine thread to a request's consumer."""

    delta_text: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set when finish_reason == "error"


@dataclass
class RequestTimes:
    """Monotonic timestamps of one request, kept by the engine thread (for metrics)."""

    arrival: float
    scheduled: float | None = None  # start of the first step that computed its rows
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class FillRows:
    """How a filled request's prompt rows were computed (for usage and metrics): filled +
    exact_prefix + tail = the prompt's length. Until the request finishes, exact_prefix is 0
    and filled is the whole prefix (Sequence.fill_boundary); when it finishes, the rows its
    selectors chose (Sequence.exact_rows) move from filled to exact_prefix."""

    filled: int  # prefix rows whose late-layer K/V was predicted, not computed
    exact_prefix: int  # prefix rows chosen to run exactly (len(Sequence.exact_rows))
    tail: int  # the last rows, run through every layer
    split: int


@dataclass(eq=False)
class RequestHandle:
    """The event-loop side of one request: await `events` until an event says finished."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    fill: bool = True  # False: exact prefill even when the engine's fill is on
    rows: RowsConfig | None = None  # this request's exact-row selectors; None: the engine's
    seq: Sequence | None = None  # set by the engine thread once added
    fill_rows: FillRows | None = None  # set with seq when its prefix is filled (final once finished)
    cancelled: bool = False  # NOTE: only written under AsyncEngine._lock

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.seq.output_ids) if self.seq is not None else 0


class EngineObserver:
    """Hooks for metrics; called on the engine thread. Default: do nothing."""

    def on_step(self, engine: Engine, num_waiting: int, step_seconds: float) -> None: ...

    def on_tokens(self, handle: RequestHandle, count: int, now: float, prev: float | None) -> None:
        """`count` tokens delivered at `now`; `prev` is the previous delivery (None: first)."""

    def on_finish(self, handle: RequestHandle) -> None: ...


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued: int, observer: EngineObserver | None = None):
        self.engine = engine
        # NOTE: capacity counts requests admitted and not finished: all that can run at
        # once plus max_queued waiting. Beyond it, refuse fast instead of queueing forever.
        self.capacity = engine.config.scheduler.max_num_seqs + max_queued
        self.observer = observer or EngineObserver()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._active: dict[int, RequestHandle] = {}  # seq_id -> handle; engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ridgefill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- event-loop side ----------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, fill: bool = True,
               rows: RowsConfig | None = None) -> RequestHandle:
        """Validate and enqueue; raises InputError, EngineOverloaded or EngineStopped.
        `fill=False` asks for exact prefill even when the engine's fill is on; `rows` replaces
        the engine's exact-row selectors for this request (Engine.add_request)."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        self.engine.validate(prompt_ids, params)  # reads only immutable model facts
        with self._lock:
            if self._in_flight >= self.capacity:
                raise EngineOverloaded(f"the server is at capacity ({self.capacity} requests in flight)")
            self._in_flight += 1
        handle = RequestHandle(list(prompt_ids), params, asyncio.get_running_loop(), fill=fill, rows=rows)
        self._inbox.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (client went away); its blocks are freed before the next step."""
        with self._lock:
            handle.cancelled = True
        self._inbox.put(("abort", handle))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- engine thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            # NOTE: block only when idle; with work, drain what arrived and step again.
            block = not self.engine.has_unfinished()
            if not self._drain(block):
                break
            if self.engine.has_unfinished():
                self._step()
        for handle in list(self._active.values()):
            self.engine.abort(handle.seq)  # NOTE: leave the Engine clean; it may be reused
            self._fail(handle, "abort", "the server is shutting down")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; returns False on stop."""
        while True:
            try:
                kind, handle = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(handle)
            elif kind == "abort" and handle.seq is not None and not handle.seq.finished:
                self.engine.abort(handle.seq)
                self._finish(handle, StreamEvent("", [], True, "abort"))

    def _add(self, handle: RequestHandle) -> None:
        if handle.cancelled:  # gone before it reached the engine
            self._finish(handle, StreamEvent("", [], True, "abort"))
            return
        try:
            seq = self.engine.add_request(handle.prompt_ids, handle.params, fill=handle.fill, rows=handle.rows)
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the loop
            self._finish(handle, StreamEvent("", [], True, "error", str(e)))
            return
        if seq.fill_boundary > 0:
            # NOTE: written before any event of this request is sent, so readers on the
            # event loop (usage) see it once they have an event.
            handle.fill_rows = FillRows(filled=seq.fill_boundary, exact_prefix=0,
                                        tail=len(seq.prompt_ids) - seq.fill_boundary,
                                        split=self.engine.fill.split)
        handle.seq = seq
        self._active[handle.seq.seq_id] = handle

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001
            log.exception("engine step failed; retrying its sequences one at a time")
            self._isolate_fault()
            return
        self._deliver(outputs, t0)

    def _isolate_fault(self) -> None:
        sched = self.engine.scheduler
        suspects = list(sched.running)
        waiting = deque(sched.waiting)
        for seq in suspects:
            if seq.finished:
                continue
            # NOTE: run seq alone by hiding every other sequence from the scheduler.
            sched.running, sched.waiting = [seq], deque()
            t0 = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001
                handle = self._active.get(seq.seq_id)
                self.engine.abort(seq)
                seq.finish_reason = "error"
                if handle is not None:
                    self._fail(handle, "error", f"request failed in the engine: {type(e).__name__}: {e}")
                outputs = []
            waiting.extendleft(s for s in sched.waiting if not s.finished)  # preempted while alone
            self._deliver(outputs, t0)
        # Give the scheduler back everyone still alive, in their original order.
        sched.running = [s for s in suspects if s.status is SeqStatus.RUNNING]
        sched.waiting = deque(s for s in waiting if not s.finished)

    def _deliver(self, outputs, t0: float) -> None:
        now = time.monotonic()
        for handle in self._active.values():
            if handle.times.scheduled is None and handle.seq.num_computed > 0:
                handle.times.scheduled = t0
        for out in outputs:
            handle = self._active.get(out.seq.seq_id)
            if handle is None:
                continue
            if out.new_token_ids:
                prev = handle.times.last_token
                if prev is None:
                    handle.times.first_token = now
                handle.times.last_token = now
                self.observer.on_tokens(handle, len(out.new_token_ids), now, prev)
            event = StreamEvent(out.delta_text, out.new_token_ids, out.finished, out.seq.finish_reason)
            if out.finished:
                self._finish(handle, event)
            else:
                self._send(handle, event)
        self.observer.on_step(self.engine, self._inbox.qsize(), now - t0)

    def _fail(self, handle: RequestHandle, reason: str, message: str) -> None:
        self._finish(handle, StreamEvent("", [], True, reason, message))

    def _finish(self, handle: RequestHandle, event: StreamEvent) -> None:
        if handle.seq is not None:
            self._active.pop(handle.seq.seq_id, None)
            if handle.fill_rows is not None:
                # NOTE: the prefill is over (or abandoned), so the exact rows are final; written
                # before the finishing event is sent, so usage read after it sees them.
                exact = len(handle.seq.exact_rows)
                handle.fill_rows = dataclasses.replace(
                    handle.fill_rows, filled=handle.seq.fill_boundary - exact, exact_prefix=exact)
        handle.times.finished = time.monotonic()
        with self._lock:
            self._in_flight -= 1
        self.observer.on_finish(handle)
        self._send(handle, event)

    @staticmethod
    def _send(handle: RequestHandle, event: StreamEvent) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.events.put_nowait, event)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more
