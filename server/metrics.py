"""Prometheus metrics, fed by the engine thread through EngineObserver hooks.

Each server gets its own CollectorRegistry, so tests can run several apps in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from ridgefill_runtime.async_engine import EngineObserver, RequestHandle

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics(EngineObserver):
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        h = lambda name, doc: Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=r)  # noqa: E731
        self.ttft = h("ridgefill_time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = h("ridgefill_inter_token_latency_seconds", "Time between successive token deliveries")
        self.e2e = h("ridgefill_e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = h("ridgefill_request_queue_time_seconds", "Arrival to first scheduled step")
        self.prefill_time = h("ridgefill_request_prefill_time_seconds", "First scheduled step to first token")
        self.decode_time = h("ridgefill_request_decode_time_seconds", "First token to last token")
        self.step_time = h("ridgefill_engine_step_seconds", "Wall time of one engine step")
        self.running = Gauge("ridgefill_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("ridgefill_num_requests_waiting", "Requests queued, not yet running", registry=r)
        self.kv_usage = Gauge("ridgefill_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.prompt_tokens = Counter("ridgefill_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("ridgefill_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("ridgefill_request_finished", "Finished requests by reason",
                                ["finish_reason"], registry=r)
        # Counted when a filled request finishes (like the prompt tokens); exact requests add nothing.
        self.filled_rows = Counter("ridgefill_fill_filled_rows", "Prompt rows filled (late-layer K/V predicted, not computed)", registry=r)
        self.exact_prefix_rows = Counter("ridgefill_fill_exact_prefix_rows", "Exact prefix rows in filled prompts", registry=r)
        self.tail_rows = Counter("ridgefill_fill_tail_rows", "Exact tail rows in filled prompts", registry=r)
        self.http_requests = Counter("ridgefill_http_requests", "HTTP requests by route and status",
                                     ["route", "status"], registry=r)

    # -- EngineObserver (engine thread) -------------------------------------------------------

    def on_step(self, engine, num_waiting: int, step_seconds: float) -> None:
        self.step_time.observe(step_seconds)
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting) + num_waiting)
        self.kv_usage.set(engine.blocks.usage())

    def on_tokens(self, handle: RequestHandle, count: int, now: float, prev: float | None) -> None:
        if prev is None:
            self.ttft.observe(now - handle.times.arrival)
        else:
            self.itl.observe(now - prev)
        self.generation_tokens.inc(count)

    def on_finish(self, handle: RequestHandle) -> None:
        t = handle.times
        self.e2e.observe(t.finished - t.arrival)
        if t.scheduled is not None:
            self.queue_time.observe(t.scheduled - t.arrival)
            if t.first_token is not None:
                self.prefill_time.observe(t.first_token - t.scheduled)
        if t.first_token is not None and t.last_token is not None:
            self.decode_time.observe(t.last_token - t.first_token)
        self.prompt_tokens.inc(handle.num_prompt_tokens)
        if handle.fill_rows is not None:
            self.filled_rows.inc(handle.fill_rows.filled)
            self.exact_prefix_rows.inc(handle.fill_rows.exact_prefix)
            self.tail_rows.inc(handle.fill_rows.tail)
        reason = handle.seq.finish_reason if handle.seq is not None else "abort"
        self.finished.labels(finish_reason=reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
