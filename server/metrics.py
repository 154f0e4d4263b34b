"""Prometheus metrics: latencies and token counts fed by the engine thread through
EngineObserver hooks; gauges and engine counters read from the AsyncEngine's stats snapshot at
scrape time, so a scrape never shows values older than the last step or command.

Each server gets its own CollectorRegistry, so tests can run several apps in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ridgefill_runtime.async_engine import EngineObserver, RequestHandle, ServingStats
from ridgefill_runtime.engine import EngineStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
# What the snapshot-backed metrics read before an engine is bound (the model is loading).
_UNBOUND = ServingStats(
    EngineStats(
        running=0,
        waiting=0,
        kv_blocks_used=0,
        kv_blocks_total=0,
        preemptions_total=0,
        aborts_total=0,
        timeouts_total=0,
        steps_total=0,
        idle_spins_total=0,
    ),
    inbox=0,
    in_flight=0,
)
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
        self._snapshot = _SnapshotCollector()
        r.register(self._snapshot)
        self.prompt_tokens = Counter("ridgefill_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("ridgefill_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter(
            "ridgefill_request_finished", "Finished requests by reason", ["finish_reason"], registry=r
        )
        # Counted when a filled request finishes (like the prompt tokens); exact requests add nothing.
        self.filled_rows = Counter(
            "ridgefill_fill_filled_rows", "Prompt rows filled (late-layer K/V predicted, not computed)", registry=r
        )
        self.exact_prefix_rows = Counter(
            "ridgefill_fill_exact_prefix_rows", "Exact prefix rows in filled prompts", registry=r
        )
        self.tail_rows = Counter("ridgefill_fill_tail_rows", "Exact tail rows in filled prompts", registry=r)
        self.structured_requests = Counter(
            "ridgefill_structured_requests",
            "Requests with a structured output, by grammar kind (json_schema, regex, choice, lark; tools: a required call)",
            ["kind"],
            registry=r,
        )
        self.http_requests = Counter(
            "ridgefill_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )

    def bind(self, stats: Callable[[], ServingStats]) -> None:
        """Read the gauges (running, waiting, KV usage) and the engine counters (preemptions,
        aborts, timeouts, idle spins) from `stats` at every scrape, e.g.
        `metrics.bind(async_engine.stats)`; it must be safe to call from any thread.
        AsyncEngine binds its observer when it is built, so binding again is harmless.
        Until bound, those metrics read 0."""
        self._snapshot.read = stats

    # -- EngineObserver (engine thread) -------------------------------------------------------

    def on_step(self, engine, num_waiting: int, step_seconds: float) -> None:
        self.step_time.observe(step_seconds)

    def on_tokens(self, handle: RequestHandle, count: int, now: float, prev: float | None) -> None:
        if prev is None:
            self.ttft.observe(now - handle.times.arrival)
        else:
            self.itl.observe(now - prev)
        self.generation_tokens.inc(count)

    def on_finish(self, handle: RequestHandle) -> None:
        t = handle.times
        assert t.finished is not None, "on_finish runs once the request has finished"
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


class _SnapshotCollector:
    """Yields the snapshot-backed metrics when the registry is scraped."""

    def __init__(self) -> None:
        self.read: Callable[[], ServingStats] | None = None

    def describe(self) -> Iterator:
        return _families(None)

    def collect(self) -> Iterator:
        return _families(self.read() if self.read is not None else None)


def _families(s: ServingStats | None) -> Iterator:
    s = s if s is not None else _UNBOUND
    e = s.engine
    yield GaugeMetricFamily("ridgefill_num_requests_running", "Sequences in the running batch", value=e.running)
    yield GaugeMetricFamily(
        "ridgefill_num_requests_waiting", "Requests queued, not yet running", value=e.waiting + s.inbox
    )
    yield GaugeMetricFamily("ridgefill_kv_cache_usage_ratio", "Fraction of KV blocks in use", value=e.kv_usage)
    yield GaugeMetricFamily("ridgefill_kv_cache_blocks_used", "KV blocks in use", value=e.kv_blocks_used)
    yield GaugeMetricFamily("ridgefill_kv_cache_blocks_total", "KV blocks in the pool", value=e.kv_blocks_total)
    yield GaugeMetricFamily(
        "ridgefill_kv_cache_touched_bytes",
        "K/V pool bytes of the blocks ever used: resident from their first write on (RSS minus this is "
        "what a leak would grow)",
        value=e.kv_touched_bytes,
    )
    yield CounterMetricFamily(
        "ridgefill_preemptions", "Sequences preempted (recomputed) to free KV blocks", value=e.preemptions_total
    )
    yield CounterMetricFamily(
        "ridgefill_request_aborts", "Requests aborted (client gone, shutdown)", value=e.aborts_total
    )
    yield CounterMetricFamily("ridgefill_request_timeouts", "Requests ended at their deadline", value=e.timeouts_total)
    yield CounterMetricFamily(
        "ridgefill_spec_draft_tokens", "Speculative draft tokens proposed and verified", value=e.spec_draft_tokens_total
    )
    yield CounterMetricFamily(
        "ridgefill_spec_accepted_tokens", "Speculative draft tokens accepted", value=e.spec_accepted_tokens_total
    )
    yield CounterMetricFamily(
        "ridgefill_spec_verify_steps", "Decode steps that verified a speculative draft", value=e.spec_steps_total
    )
    # NOTE: in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits: hits / queries is the hit rate
    yield CounterMetricFamily(
        "ridgefill_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        value=e.prefix_queried_tokens_total,
    )
    yield CounterMetricFamily(
        "ridgefill_prefix_cache_hits",
        "Prompt tokens found in the prefix cache (not computed)",
        value=e.prefix_hit_tokens_total,
    )
    yield CounterMetricFamily(
        "ridgefill_prefix_cache_window_cut",
        "Prompt tokens whose blocks were cached but not the sliding-window pages they read (evicted): computed",
        value=e.prefix_window_cut_tokens_total,
    )
    yield CounterMetricFamily(
        "ridgefill_prefix_cache_state_cut",
        "Prompt tokens whose blocks were cached but with no recurrent-state snapshot after them: computed",
        value=e.prefix_state_cut_tokens_total,
    )
    yield GaugeMetricFamily(
        "ridgefill_prefix_cache_state_snapshots",
        "Recurrent-state snapshots findable in the prefix cache (hybrid models)",
        value=e.prefix_state_snapshots,
    )
    yield CounterMetricFamily(
        "ridgefill_prefix_cache_state_restores",
        "Requests that resumed a hybrid model's recurrent states from a prefix-cache snapshot",
        value=e.prefix_state_restores_total,
    )
    yield GaugeMetricFamily(
        "ridgefill_prefix_cache_blocks",
        "KV blocks findable in the prefix cache (held or not)",
        value=e.prefix_cached_blocks,
    )
    yield CounterMetricFamily(
        "ridgefill_engine_idle_spins",
        "Engine steps that found nothing to run while work existed (a scheduler bug)",
        value=e.idle_spins_total,
    )
