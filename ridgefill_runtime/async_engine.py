"""The Engine behind an asyncio server: one background thread runs the step loop.

Requests come in through a thread-safe inbox; each request's token deltas go out to its own
asyncio.Queue through `loop.call_soon_threadsafe`, so the event loop never runs model code
and the engine thread never touches asyncio objects directly.

Fault policy: when a step raises, the sequences that were running are retried one at a time;
a sequence whose solo step raises again is the culprit and fails alone ("error"), the others
keep their progress. This costs one extra step per running sequence, only after a failure.

Watchdog and shutdown: `health()` says "stalled" when work is unfinished and no step has
completed for `stall_after_s` (or the engine thread died); `stop(grace_s)` refuses new
requests at once, lets those in flight run for up to grace_s, then aborts the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import RowsConfig
from .engine import Engine, EngineStats
from .errors import ParallelError, RidgefillError
from .sequence import SamplingParams, Sequence, SeqStatus

log = logging.getLogger("ridgefill.engine")

SHUTTING_DOWN = "the server is shutting down"
# How long stop() waits for the engine thread beyond its grace: one slow step may be running.
JOIN_SLACK_S = 5.0


class EngineOverloaded(RidgefillError):
    """Too many requests are queued; the HTTP layer answers 503 with Retry-After."""


class EngineStopped(RidgefillError):
    """The engine takes no new requests (shutting down, not started, or its thread died)."""


@dataclass
class StreamEvent:
    """One message from the engine thread to a request's consumer."""

    delta_text: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" | "error" | "grammar_error"
    error: str | None = None  # set when finish_reason == "error", or an abort at shutdown
    new_logprobs: list = field(default_factory=list)  # TokenLogprobs of new_token_ids (params.logprobs)


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
    and filled is the whole prefix (Sequence.fill.boundary); when it finishes, the rows its
    selectors chose (Sequence.fill.exact_rows) move from filled to exact_prefix."""

    filled: int  # prefix rows whose late-layer K/V was predicted, not computed
    exact_prefix: int  # prefix rows chosen to run exactly (len(Sequence.fill.exact_rows))
    tail: int  # the last rows, run through every layer
    split: int
    cached_filled: int = 0  # filled rows taken from the prefix cache (Sequence.prefix.cached_filled_rows)
    remade: int = 0  # cached filled rows its selectors chose and made exact (len(Sequence.prefix.remade_rows))


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
    terminal_state: bool | None = None  # this request's terminal-state correction; None: the engine's
    reuse_filled: str | None = None  # what it takes from the prefix cache's filled blocks; None: the engine's
    deadline: float | None = None  # time.monotonic() after which it ends with "timeout"
    seq: Sequence | None = None  # set by the engine thread once added
    fill_rows: FillRows | None = None  # set with seq when its prefix is filled (final once finished)
    cancelled: bool = False  # NOTE: only written under AsyncEngine._lock

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.seq.output_ids) if self.seq is not None else 0


@dataclass(frozen=True)
class ServingStats:
    """AsyncEngine.stats(): the engine's latest snapshot plus the engine thread's inbox."""

    engine: EngineStats
    inbox: int  # commands (adds, aborts) not yet applied by the engine thread
    in_flight: int  # requests admitted and not finished

    def __post_init__(self) -> None:
        if self.inbox < 0 or self.in_flight < 0:
            raise ValueError(f"inbox ({self.inbox}) and in_flight ({self.in_flight}) must be >= 0")


@dataclass(frozen=True)
class EngineHealth:
    """AsyncEngine.health(): "ok", "stalled" (work unfinished and no step completed for
    stall_after_s, or the engine thread died) or "stopped" (not started, or stopped)."""

    status: str
    seconds_since_progress: float  # since the last completed step, or since work arrived when idle
    in_flight: int
    accepting: bool  # submit() takes new requests

    def __post_init__(self) -> None:
        if self.status not in ("ok", "stalled", "stopped"):
            raise ValueError(f"health status must be ok, stalled or stopped, got {self.status!r}")


class EngineObserver:
    """Hooks for metrics; called on the engine thread (bind: on the constructing thread).
    Default: do nothing."""

    def bind(self, stats: Callable[[], ServingStats]) -> None:
        """`stats` reads the AsyncEngine's latest snapshot from any thread."""

    def on_step(self, engine: Engine, num_waiting: int, step_seconds: float) -> None: ...

    def on_tokens(self, handle: RequestHandle, count: int, now: float, prev: float | None) -> None:
        """`count` tokens delivered at `now`; `prev` is the previous delivery (None: first)."""

    def on_finish(self, handle: RequestHandle) -> None: ...


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_queued: int,
        observer: EngineObserver | None = None,
        stall_after_s: float = 60.0,
        on_fatal: Callable[[str], None] = lambda cause: None,
    ):
        """`on_fatal(cause)`: called on the engine thread when the engine cannot go on (a lost
        tensor-parallel rank), after every request has had its error; the server ends there."""
        self.on_fatal = on_fatal
        if not stall_after_s > 0:
            raise ValueError(f"stall_after_s must be positive, got {stall_after_s}")
        self.engine = engine
        # NOTE: capacity counts requests admitted and not finished: all that can run at
        # once plus max_queued waiting. Beyond it, refuse fast instead of queueing forever.
        self.capacity = engine.config.scheduler.max_num_seqs + max_queued
        self.stall_after_s = stall_after_s
        self.observer = observer or EngineObserver()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._active: dict[int, RequestHandle] = {}  # seq_id -> handle; engine thread only
        self._thread: threading.Thread | None = None
        self._accepting = False  # NOTE: only written under _lock; submit() reads it there too
        self._closing = False  # begin_drain() or stop() was called
        self._stop_at: float | None = None  # monotonic time stop() aborts what is left
        self._last_progress = time.monotonic()
        self._snapshot = engine.stats()
        self.observer.bind(self.stats)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._last_progress = time.monotonic()
        with self._lock:
            self._accepting = True
        self._thread = threading.Thread(target=self._run, name="ridgefill-engine", daemon=True)
        self._thread.start()

    def begin_drain(self) -> None:
        """Refuse new requests from now on (EngineStopped: the server is shutting down); those
        in flight run on. For a SIGTERM handler, before stop(grace_s)."""
        with self._lock:
            self._accepting = False
            self._closing = True

    def stop(self, grace_s: float = 0.0) -> None:
        """Refuse new requests at once, let those in flight run for up to grace_s seconds, then
        abort the rest ("abort", "the server is shutting down") and join the engine thread.
        Returns within grace_s + JOIN_SLACK_S even when a step is slow (the thread is a daemon
        and aborts the rest once that step ends)."""
        if not grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.begin_drain()
        stop_at = time.monotonic() + grace_s
        self._stop_at = stop_at if self._stop_at is None else min(self._stop_at, stop_at)
        self._inbox.put(("wake", None))  # NOTE: after _stop_at is set, so the thread sees it
        if self._thread is not None:
            self._thread.join(max(0.0, self._stop_at - time.monotonic()) + JOIN_SLACK_S)
            if self._thread.is_alive():
                log.warning("the engine thread is still in a step after the shutdown grace; not waiting")

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes new requests."""
        return self._thread is not None and self._thread.is_alive() and self._accepting

    def health(self) -> EngineHealth:
        """Safe from any thread."""
        since = time.monotonic() - self._last_progress
        running = self._thread is not None and self._thread.is_alive()
        if self._thread is None or (not running and self._stop_at is not None):
            status = "stopped"
        elif not running or (self._in_flight and since > self.stall_after_s):
            status = "stalled"
        else:
            status = "ok"
        return EngineHealth(status, since, self._in_flight, self.alive)

    def stats(self) -> ServingStats:
        """The snapshot published after the latest step or command; safe from any thread."""
        return ServingStats(self._snapshot, self._inbox.qsize(), self._in_flight)

    # -- event-loop side ----------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        fill: bool = True,
        rows: RowsConfig | None = None,
        deadline: float | None = None,
        terminal_state: bool | None = None,
        reuse_filled: str | None = None,
    ) -> RequestHandle:
        """Validate and enqueue; raises InputError, EngineOverloaded or EngineStopped.
        `fill=False` asks for exact prefill even when the engine's fill is on; `rows` replaces
        the engine's exact-row selectors for this request (Engine.add_request); past `deadline`
        (time.monotonic() seconds) the request ends with finish_reason "timeout"."""
        if not self._accepting:
            raise EngineStopped(self._refusal())
        self.engine.validate(prompt_ids, params)  # reads only immutable model facts
        self.engine.check_terminal_request(terminal_state)  # NOTE: immutable engine facts, like validate
        self.engine.plan_loops(params)
        handle = RequestHandle(
            list(prompt_ids),
            params,
            asyncio.get_running_loop(),
            fill=fill,
            rows=rows,
            deadline=deadline,
            terminal_state=terminal_state,
            reuse_filled=reuse_filled,
        )
        with self._lock:
            # NOTE: checked and enqueued under the lock: once stop() has closed admission, no
            # add can land in the inbox behind its wake-up, unseen by the thread's last drain.
            if not self._accepting:
                raise EngineStopped(self._refusal())
            if self._in_flight >= self.capacity:
                raise EngineOverloaded(f"the server is at capacity ({self.capacity} requests in flight)")
            if self._in_flight == 0:
                self._last_progress = time.monotonic()  # an idle engine's stall clock starts now
            self._in_flight += 1
            self._inbox.put(("add", handle))
        return handle

    def _refusal(self) -> str:
        return SHUTTING_DOWN if self._closing else "the engine is not running"

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (client went away); its blocks are freed before the next step."""
        with self._lock:
            handle.cancelled = True
        self._inbox.put(("abort", handle))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
            self._close("abort", SHUTTING_DOWN)
        except ParallelError as e:
            log.error("%s", e)
            with self._lock:
                self._accepting = False
            self._close("error", str(e))
            self.on_fatal(str(e))
        except BaseException:  # noqa: BLE001 - the thread must not die silently
            log.exception("the engine thread failed; failing every request in flight")
            with self._lock:
                self._accepting = False
            self._close("error", "the engine thread failed")

    def _loop(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            if not busy:
                self._last_progress = time.monotonic()
            # NOTE: block only when idle and not stopping; with work, drain what arrived and step.
            self._drain(block=not busy and self._stop_at is None)
            busy = self.engine.has_unfinished()
            if self._stop_at is not None and (not busy or time.monotonic() >= self._stop_at):
                return
            if busy:
                self._step()

    def _close(self, reason: str, message: str) -> None:
        """The loop is over: end every request still known, so no consumer waits forever."""
        handles = list(self._active.values())
        for handle in handles:
            try:
                self.engine.abort(handle.seq, reason)  # NOTE: leave the Engine clean; it may be reused
            except Exception:  # noqa: BLE001 - the engine may be what failed
                log.exception("could not abort request %s", handle.seq.seq_id)
        self._publish()  # NOTE: before the events, as in _deliver
        for handle in handles:
            self._fail(handle, reason, message)
        while True:
            try:
                kind, handle = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._fail(handle, reason, message)

    def _drain(self, block: bool) -> None:
        """Apply queued commands, publishing a fresh snapshot after each."""
        while True:
            try:
                kind, handle = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(handle)
            elif kind == "abort" and handle.seq is not None and not handle.seq.finished:
                self.engine.abort(handle.seq)
                self._publish()  # NOTE: before the event, as in _deliver
                self._finish(handle, StreamEvent("", [], True, "abort"))
            self._publish()

    def _publish(self) -> None:
        self._snapshot = self.engine.stats()  # NOTE: one frozen object, swapped atomically

    def _add(self, handle: RequestHandle) -> None:
        if handle.cancelled:  # gone before it reached the engine
            self._finish(handle, StreamEvent("", [], True, "abort"))
            return
        try:
            seq = self.engine.add_request(
                handle.prompt_ids,
                handle.params,
                fill=handle.fill,
                rows=handle.rows,
                terminal_state=handle.terminal_state,
                reuse_filled=handle.reuse_filled,
                deadline=handle.deadline,
            )
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the loop
            self._finish(handle, StreamEvent("", [], True, "error", str(e)))
            return
        if seq.fill.boundary > 0:
            # NOTE: written before any event of this request is sent, so readers on the
            # event loop (usage) see it once they have an event.
            handle.fill_rows = FillRows(
                filled=seq.fill.boundary,
                exact_prefix=0,
                tail=len(seq.prompt_ids) - seq.fill.boundary,
                split=self.engine.fill.split,
            )
        handle.seq = seq
        self._active[handle.seq.seq_id] = handle

    def _step(self) -> None:
        t0 = time.monotonic()
        ran = self.engine.counts.steps
        try:
            outputs = self.engine.step()
        except ParallelError:
            raise  # NOTE: a lost rank ends the engine (_run); no request alone could step without it
        except Exception:  # noqa: BLE001
            log.exception("engine step failed; retrying its sequences one at a time")
            self._isolate_fault()
        else:
            self._deliver(outputs, t0)
            if self.engine.counts.steps > ran:
                self.observer.on_step(self.engine, self._inbox.qsize(), time.monotonic() - t0)
        if self.engine.counts.steps > ran:
            self._last_progress = time.monotonic()
        self._publish()

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
                self.engine.abort(seq, "error")
                if handle is not None:
                    self._fail(handle, "error", f"request failed in the engine: {type(e).__name__}: {e}")
                outputs = []
            waiting.extendleft(s for s in sched.waiting if not s.finished)  # preempted while alone
            self._deliver(outputs, t0)
            self.observer.on_step(self.engine, self._inbox.qsize(), time.monotonic() - t0)
        # Give the scheduler back everyone still alive, in their original order.
        sched.running = [s for s in suspects if s.status is SeqStatus.RUNNING]
        sched.waiting = deque(s for s in waiting if not s.finished)

    def _deliver(self, outputs, t0: float) -> None:
        # NOTE: publish before any event goes out, so whoever sees a request end reads stats
        # that already count it.
        self._publish()
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
            event = StreamEvent(
                out.delta_text, out.new_token_ids, out.finished, out.seq.finish_reason, new_logprobs=out.new_logprobs
            )
            if out.finished:
                self._finish(handle, event)
            else:
                self._send(handle, event)

    def _fail(self, handle: RequestHandle, reason: str, message: str) -> None:
        self._finish(handle, StreamEvent("", [], True, reason, message))

    def _finish(self, handle: RequestHandle, event: StreamEvent) -> None:
        if handle.seq is not None:
            self._active.pop(handle.seq.seq_id, None)
            if handle.fill_rows is not None:
                # NOTE: the prefill is over (or abandoned), so the exact rows are final; written
                # before the finishing event is sent, so usage read after it sees them.
                seq = handle.seq
                exact = len(seq.fill.exact_rows)
                handle.fill_rows = dataclasses.replace(
                    handle.fill_rows,
                    filled=seq.fill.boundary - exact,
                    exact_prefix=exact,
                    cached_filled=min(seq.prefix.cached_filled_rows, seq.fill.boundary) - len(seq.prefix.remade_rows),
                    remade=len(seq.prefix.remade_rows),
                )
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
