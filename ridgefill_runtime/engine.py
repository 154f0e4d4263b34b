"""The step loop: schedule -> run -> postprocess. Owns the scheduler, runner and caches."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch

from .cache.build import CacheBudget, build_caches
from .decode_graphs import engine_decode_graphs, wants_decode_graphs
from .cache.prefix_cache import EXACT, fill_identity, loop_identity
from .cache.spec import spec_of
from .config import REUSE_POLICIES, EngineConfig, RowsConfig, SpeculativeConfig
from .detokenize import TextTracker
from .errors import InputError
from .fill.plan import rewrites_filled_rows
from .fill.select import RowSelector
from .fill.tokens import TokenTable, load_counts
from .grammar.book import GrammarBook
from .grammar.constrain import Constrainer
from .runner import Runner
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence
from .config import LoopPlan
from .loop_plan import resolve_loops
from .speculative import NgramProposer, no_drafts, self_draft_slots

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# A step that finds nothing to run while work exists is a scheduler bug; sleeping this long
# keeps the loop from burning a core until the work ends (abort, timeout) or the bug is fixed.
IDLE_BACKOFF_S = 0.01

log = logging.getLogger("ridgefill.engine")


@dataclass
class RequestOutput:
    seq: Sequence
    delta_text: str
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list = field(default_factory=list)  # TokenLogprobs of new_token_ids (params.logprobs)


@dataclass(frozen=True)
class EngineStats:
    """One consistent reading of the engine's gauges and counters (Engine.stats)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions_total: int
    aborts_total: int
    timeouts_total: int
    steps_total: int  # steps that ran the model
    idle_spins_total: int  # steps that found nothing to run while work existed (a bug)
    state_slots_used: int = 0  # per-sequence state slots held (recurrent states, stashes)
    state_slots_total: int = 0
    stash_bytes: int = 0  # split-state stashes held by two-sweep prefills
    spec_steps_total: int = 0  # decode items that verified a draft (speculative decoding)
    spec_draft_tokens_total: int = 0  # draft tokens proposed and verified
    spec_accepted_tokens_total: int = 0  # of those, accepted (each saved one decode step)
    prefix_cached_blocks: int = 0  # blocks findable in the prefix cache (held or not)
    prefix_queried_tokens_total: int = 0  # prompt tokens admissions looked up in the prefix cache
    prefix_hit_tokens_total: int = 0  # of those, found (their K/V were not computed again)
    prefix_window_cut_tokens_total: int = 0  # not found: their window pages were evicted
    prefix_state_cut_tokens_total: int = 0  # not found: no state snapshot after their blocks
    prefix_state_snapshots: int = 0  # recurrent-state snapshots findable (hybrid models)
    prefix_state_restores_total: int = 0  # admissions that resumed from one
    kv_touched_bytes: int = 0  # K/V pool bytes ever written (the pool is allocated, not touched, at start)

    def __post_init__(self) -> None:
        if not 0 <= self.kv_blocks_used <= self.kv_blocks_total:
            raise ValueError(f"kv blocks used {self.kv_blocks_used} outside 0..{self.kv_blocks_total}")
        if not 0 <= self.state_slots_used <= self.state_slots_total:
            raise ValueError(f"state slots used {self.state_slots_used} outside 0..{self.state_slots_total}")

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class _Counts:
    aborts: int = 0
    timeouts: int = 0
    steps: int = 0
    idle_spins: int = 0


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, fill_maps=None, relay=None):
        """`relay`: a tensor-parallel rank 0's parallel/relay.StepRelay; each step and each pool
        hook then also reaches the other ranks (the model holds this rank's shard)."""
        cfg = model.config
        if hasattr(tokenizer, "for_model_rows") and cfg.vocab_size > tokenizer.vocab_size:
            # A padded vocabulary: rows past the tokenizer decode to nothing (finding 6 of issue 31).
            # NOTE: only then: a tokenizer that needs no padding stays the object given (a wrapper).
            tokenizer = tokenizer.for_model_rows(cfg.vocab_size)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        cache_spec = spec_of(model, config.looped)
        self.speculative = config.speculative
        self.loop_store = _loop_store(cache_spec, config)
        if self.speculative.enabled and not cache_spec.rolls_back:
            # NOTE: a rejected draft row has already updated a recurrent state; rolling that back
            # needs the layer's per-row snapshots (RecurrentCache.rollback_parts).
            raise ValueError(
                f"speculative.method = {self.speculative.method!r}: this model has recurrent "
                f"layers {list(cache_spec.recurrent_layers)}, whose states cannot be rolled back "
                f'past rejected draft tokens; use speculative.method = "off"'
            )
        self.prefix_caching = prefix_caching_on(config.cache.prefix_caching, cache_spec)
        budget = engine_budget(
            config,
            cfg.max_position_embeddings,
            self.loop_store is not None,
            window_bounded=config.cache.window_bounded,
            snapshots=snapshot_count(config.cache, cache_spec) if self.prefix_caching else 0,
        )
        self.caches = build_caches(cache_spec, budget, model.device)
        self.kv = self.caches.kv
        # NOTE: a cached filled block must hold every filled row's K/V (another request's rows reach
        # others), and the rescale rewrites them all at once: otherwise the fill writes a filled row's
        # sliding-window late K/V only when a late row reaches it, and those pages come with the late
        # sweep. Filled requests stay out of the prefix cache where it could not reuse their blocks
        self.filled_uncached = filled_uncached_why(self.caches)
        if self.prefix_caching and config.fill.enabled and self.filled_uncached:
            log.warning("prefix cache: filled requests take no cached blocks on this model: %s", self.filled_uncached)
        defer = (not self.prefix_caching or bool(self.filled_uncached)) and not rewrites_filled_rows(config.fill)
        manager = self.caches.manager(  # the scheduler owns it
            self.prefix_caching, lazy_late_pages=defer, snapshot_every=config.cache.snapshot_every, relay=relay
        )
        self.relay = relay
        self.blocks = manager.blocks
        self.fill = config.fill
        propose = NgramProposer(self.speculative) if self.speculative.method == "ngram" else no_drafts
        if self.loop_store is not None and config.looped.block > 0:
            propose = self_draft_slots
        self.scheduler = Scheduler(
            config.scheduler, manager, RowSelector(token_table(tokenizer, self.fill.rows)), propose
        )
        if self.fill.enabled and cache_spec.stash_width == 0:
            raise ValueError(
                f"fill.mode: RidgeFill's two-sweep prefill is not built for {cfg.architecture} models "
                f'yet; use fill.mode = "off"'
            )
        self.carries_late_state = self.fill.enabled and carries_late_state(cache_spec, self.fill.split)
        if self.fill.terminal_state:
            _check_terminal_shift(cache_spec, self.fill.split, fill_maps)
        if self.fill.enabled and not 0 < self.fill.split < cfg.num_layers:
            raise ValueError(f"fill.split must be in 1..{cfg.num_layers - 1} for this model, got {self.fill.split}")
        self.max_model_len = min(cfg.max_position_embeddings, self.caches.max_tokens)
        # NOTE: a captured graph would replay no all-reduce of the step channel's making: tensor-
        # parallel ranks run decode steps eagerly (untested on GPUs with NCCL so far)
        sharded = config.parallel.tensor_parallel_size > 1
        graphs = None if sharded else engine_decode_graphs(model, self.caches, config, self.max_model_len)
        # NOTE: without a Hugging Face tokenizers backend (a model served as token ids only) no
        # grammar can be spelled in tokens: Engine.validate refuses structured requests by name
        self.grammars = GrammarBook(tokenizer, config.structured) if hasattr(tokenizer, "backend") else None
        constrainer = Constrainer(self.grammars, cfg.vocab_size, torch.get_num_threads()) if self.grammars else None
        self.runner = Runner(
            model,
            self.caches,
            self.caches.block_size,
            self.fill,
            fill_maps,
            defer_windows=defer,
            graphs=graphs,
            constrainer=constrainer,
        )
        if relay is not None:
            self.runner = relay.wrap_runner(self.runner)
        self.maps_digest = _file_digest(fill_maps.path) if fill_maps is not None else ""
        self.text = TextTracker(tokenizer)
        self.eos_ids = tuple(cfg.eos_token_ids) or tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.counts = _Counts()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank). Idempotent."""
        if self.relay is not None:
            self.relay.stop()

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        fill: bool = True,
        rows: RowsConfig | None = None,
        hide_from: int | None = None,
        deadline: float | None = None,
        terminal_state: bool | None = None,
        reuse_filled: str | None = None,
    ) -> Sequence:
        """Queue a request. `fill=False` asks for an exact prefill even when the fill is on;
        `rows` overrides the configured exact-row selectors for this request; `hide_from`
        (evaluation: the question-hidden control) shows the selectors only positions before it;
        past `deadline` (time.monotonic() seconds) it ends with finish_reason "timeout";
        `terminal_state` turns the terminal-state correction on or off for this request (None:
        fill.corrections.terminal_state); `reuse_filled` what a filled request takes from the
        prefix cache (None: fill.reuse_filled)."""
        self.validate(prompt_ids, params)
        self.check_terminal_request(terminal_state)
        seq = Sequence(prompt_ids=list(prompt_ids), params=params, deadline=deadline)
        apply_fill(seq, self.fill, fill, rows, hide_from, self.carries_late_state)
        if terminal_state is not None:
            seq.fill.terminal_state = seq.fill.carry_all_rows and terminal_state
        policy = reuse_filled or self.fill.reuse_filled
        seq.prefix.identity = cache_identity(seq, self.fill, self.maps_digest, policy)
        if seq.fill.boundary and self.filled_uncached:
            seq.prefix.identity = None
        seq.prefix.reselect = policy == "reselect"
        seq.spec.max_draft = spec_tokens(self.speculative, params)
        seq.loop = self.plan_loops(params)
        if seq.loop is not None:
            seq.spec.max_draft = seq.loop.block
            seq.prefix.identity = loop_identity(seq.loop.loops, seq.loop.window, params.seed or 0)
        self.scheduler.add(seq)
        return seq

    def plan_loops(self, params: SamplingParams) -> LoopPlan | None:
        """A looped model's loop plan for a request (its overrides checked against the stored
        planes; InputError names the field); None for other models."""
        if self.loop_store is None:
            if params.looped is not None:
                raise InputError("ridgefill.loops: loop settings are for looped models; this one runs each layer once")
            return None
        speculates = params.greedy and not params.prompt_logprobs
        return resolve_loops(self.config.looped, self.loop_store, params.looped, speculates=speculates)

    def check_terminal_request(self, terminal_state: bool | None) -> None:
        """A request may ask for the terminal-state correction only where maps hold ΔM."""
        if terminal_state and not self.runner.has_terminal_shift:
            raise InputError(
                'the terminal-state correction needs a hybrid model served with fill.mode = "plain" '
                "and maps holding ΔM (`ridgefill fit --terminal-state`)"
            )

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InputError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        # NOTE: this bound is what keeps the scheduler live: a request alone always fits the
        # pool (it never holds more than prompt + max_tokens - 1 positions, fill stages included).
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_model_len:
            raise InputError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need} "
                f"exceeds the context length of {self.max_model_len} tokens"
            )
        if params.grammar is not None and self.grammars is None:
            raise InputError(
                f"{params.grammar.param}: this model's tokenizer cannot spell a grammar in tokens, so it serves "
                "no structured outputs"
            )

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        """End seq now, wherever it is, and drop everything kept for it."""
        if seq.finished:
            return
        self.scheduler.finish(seq, reason)
        self._forget(seq)
        if reason == "abort":
            self.counts.aborts += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        c, held, spec = self.counts, self.scheduler.caches.stats(), self.scheduler.spec
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_used=held.kv_blocks_used,
            kv_blocks_total=held.kv_blocks_total,
            preemptions_total=self.scheduler.num_preemptions,
            aborts_total=c.aborts,
            timeouts_total=c.timeouts,
            steps_total=c.steps,
            idle_spins_total=c.idle_spins,
            state_slots_used=held.state_slots_used,
            state_slots_total=held.state_slots_total,
            stash_bytes=held.stash_bytes,
            spec_steps_total=spec.steps,
            spec_draft_tokens_total=spec.proposed,
            spec_accepted_tokens_total=spec.accepted,
            prefix_cached_blocks=held.prefix_cached_blocks,
            prefix_queried_tokens_total=held.prefix_queried_tokens,
            prefix_hit_tokens_total=held.prefix_hit_tokens,
            prefix_window_cut_tokens_total=held.prefix_window_cut_tokens,
            prefix_state_cut_tokens_total=held.prefix_state_cut_tokens,
            prefix_state_snapshots=held.state_snapshots,
            prefix_state_restores_total=held.state_restores,
            kv_touched_bytes=held.kv_touched_bytes,
        )

    # -- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; the sequences that gained text or finished (timeouts included)."""
        expired = self._expire()
        preemptions = self.scheduler.num_preemptions
        items = self.scheduler.schedule()
        if not items:
            # NOTE: a step that preempted freed blocks: only a partial view of the sequences
            # (fault isolation) can leave it empty, which is no bug.
            if self.scheduler.has_work() and self.scheduler.num_preemptions == preemptions:
                self._idle_spin()
            return expired
        before = {id(it.seq): len(it.seq.output_ids) for it in items}
        result = self.runner.run(items)
        self.counts.steps += 1
        touched = self.scheduler.postprocess(items, result, self.eos_ids)
        return expired + [self._output(seq, before[id(seq)]) for seq in touched]

    def _expire(self) -> list[RequestOutput]:
        expired = self.scheduler.expire(time.monotonic())
        self.counts.timeouts += len(expired)
        return [self._output(seq, len(seq.output_ids)) for seq in expired]

    def _idle_spin(self) -> None:
        self.counts.idle_spins += 1
        if self.counts.idle_spins == 1:
            log.error(
                "the scheduler found nothing to run with %d running and %d waiting sequences "
                "(%d of %d KV blocks free); backing off %.0f ms per step (counted in idle spins)",
                len(self.scheduler.running),
                len(self.scheduler.waiting),
                self.blocks.num_free,
                self.blocks.num_blocks,
                IDLE_BACKOFF_S * 1000,
            )
        time.sleep(IDLE_BACKOFF_S)

    def _forget(self, seq: Sequence) -> None:
        self.runner.forget(seq.seq_id)
        self.text.forget(seq.seq_id)

    def _drop_past_stop(self, seq: Sequence, had: int) -> None:
        """An accepted run went past a stop string: keep the tokens up to the one that
        completed it, as one-token steps would have. The text is already cut at the stop."""
        for n in range(had + 1, len(seq.output_ids)):
            text = self.tokenizer.decode(seq.output_ids[:n], skip_special_tokens=True)
            if any(stop in text for stop in seq.params.stop):
                del seq.output_ids[n:]
                del seq.logprobs.output[n:]
                return

    def _output(self, seq: Sequence, had: int) -> RequestOutput:
        delta, hit_stop = self.text.update(seq)
        if hit_stop and len(seq.output_ids) - had > 1:
            self._drop_past_stop(seq, had)
        if hit_stop and not seq.finished:
            self.scheduler.finish(seq, "stop")  # NOTE: update() already emitted the cut text
        if seq.finished:
            self._forget(seq)
        return RequestOutput(
            seq=seq,
            delta_text=delta,
            new_token_ids=seq.output_ids[had:],
            finished=seq.finished,
            new_logprobs=seq.logprobs.output[had:],
        )


def spec_tokens(config: SpeculativeConfig, params: SamplingParams) -> int:
    """Most drafts a request's decode steps verify: the engine's num_tokens, or fewer if the
    request asks (params.speculative; 0: off). Only greedy requests speculate (acceptance
    compares drafts with the argmax; a structured output's argmax is its grammar's, grammar/constrain.py),
    and scoring requests never do."""
    if not config.enabled or not params.greedy or params.prompt_logprobs:
        return 0
    asked = config.num_tokens if params.speculative is None else params.speculative
    return min(asked, config.num_tokens)


def _loop_store(spec, config: EngineConfig):
    """A looped model's stored planes (None for other models), its [looped] table checked against them."""
    if not spec.loop_layers:
        return None
    if config.speculative.enabled:
        raise ValueError(
            "speculative.method: a looped model drafts for itself (looped.block, Algorithm 1); "
            'use speculative.method = "off"'
        )
    store = spec.layers[spec.loop_layers[0]]
    try:
        resolve_loops(config.looped, store, None, speculates=True)
    except InputError as e:
        raise ValueError(str(e).replace("ridgefill.", "looped.")) from None
    return store


def filled_uncached_why(caches) -> str:
    """Why filled requests stay out of the prefix cache on this model ("" where they take part)."""
    if caches.layout is not None:
        # NOTE: so a filled prefill keeps its late window pages lazy (benchmarks/window_kv_memory.md)
        return (
            "sliding-window pages: a cached filled block would need every filled row written at once, and a "
            "reselecting hit would remake rows whose window pages are gone"
        )
    if caches.spec.snapshot_bytes():
        return (
            "recurrent states: a filled prefix's late states are approximate, and no snapshot names the fill "
            "that made them"
        )
    return ""


def snapshot_count(cache, spec) -> int:
    """Recurrent-state snapshots for the prefix cache: cache.state_snapshots, else as many as fit
    in a tenth of the K/V budget (at most 1024); 0 for a model without recurrent layers."""
    size = spec.snapshot_bytes()
    if not size:
        return 0
    if cache.state_snapshots is not None:
        return cache.state_snapshots
    return max(1, min(1024, int(cache.kv_cache_gib * 2**30 / 10) // size))


def engine_budget(
    config: EngineConfig, max_positions: int, looped: bool = False, window_bounded: bool = False, snapshots: int = 0
) -> CacheBudget:
    """The engine's caches: the configured KV pool, one state slot per sequence that may run
    (admission never waits on a slot, so liveness rests on the blocks alone)."""
    c = config.cache
    history = config.speculative.num_tokens + 1 if config.speculative.enabled else 0  # rows per verification
    if looped and config.looped.block > 0:
        history = config.looped.block + 1
    if looped and c.kv_dtype == "int8":
        # NOTE: its loop planes read back through the pool and would dequantize, but no agreement bound has
        # been measured for them (the tiny looped model drifts under bfloat16 already): refused, not guessed
        raise ValueError(
            'cache.kv_dtype = "int8" is not supported for looped models (its loss on the loop planes is unmeasured); use float16 or bfloat16'
        )
    kv_dtype = None if c.kv_dtype == "auto" else {**_DTYPES, "int8": torch.int8}[c.kv_dtype]
    return CacheBudget(
        block_size=c.block_size,
        num_blocks=c.num_blocks,
        kv_cache_gib=c.kv_cache_gib,
        kv_dtype=kv_dtype,
        state_slots=config.scheduler.max_num_seqs,
        max_positions=max_positions,
        history_rows=history,
        window_bounded=window_bounded,
        fill_split=config.fill.split if config.fill.enabled else 0,
        scratch_slot=wants_decode_graphs(config),
        state_snapshots=snapshots,
    )


def apply_fill(
    seq: Sequence,
    fill,
    wanted: bool = True,
    rows: RowsConfig | None = None,
    hide_from: int | None = None,
    carry: bool = False,
) -> None:
    """Set a new sequence's fill: prompt rows before len - tail are filled (when the fill is on
    and the prompt is longer than the tail), with these exact-row selectors. `carry`: the model
    has recurrent layers above the split (carries_late_state), whose state the filled rows carry."""
    n = len(seq.prompt_ids)
    if not (wanted and fill.enabled and n > fill.tail):
        return
    if hide_from is not None and not 0 < hide_from <= n:
        raise InputError(f"hide_from must be in 1..{n}, got {hide_from}")
    seq.fill.boundary, seq.fill.arm = n - fill.tail, fill.arm
    seq.fill.rows, seq.fill.hide_from = rows or fill.rows, hide_from
    seq.fill.carry_all_rows = carry and fill.arm in ("identity", "ridgefill")
    seq.fill.terminal_state = seq.fill.carry_all_rows and fill.terminal_state


def prefix_caching_on(setting: str, spec) -> bool:
    """cache.prefix_caching: "auto" turns it on where the model's caches are K/V only (sliding-
    window layers included: their pages are cached as they are let go, cache/window_pages.py)."""
    if setting == "on" and not spec.prefix_cacheable:
        raise ValueError('cache.prefix_caching = "on": ' + spec.why_not_prefix_cacheable())
    if setting == "auto":
        if not spec.prefix_cacheable:  # NOTE: once per engine: a cache left off silently looks like one that never hits
            log.warning(
                'cache.prefix_caching = "auto" leaves the prefix cache off for this model: %s',
                spec.why_not_prefix_cacheable(),
            )
        return spec.prefix_cacheable
    return setting == "on"


def cache_identity(seq: Sequence, fill, maps_digest: str, policy: str) -> bytes | None:
    """The identity seq's blocks are published and looked up under (cache/prefix_cache.py);
    None keeps it out of the prefix cache."""
    if policy not in REUSE_POLICIES:
        raise InputError(f"reuse_filled must be one of {', '.join(REUSE_POLICIES)}, got {policy!r}")
    if not seq.fill.boundary:
        return EXACT
    # NOTE: these change cached rows after they are written (the rescale multiplies every filled
    # row's K/V), leave them out of the late layers' reach (nofill), or carry a recurrent state
    # over them: none leaves blocks another request could start from.
    if seq.fill.arm == "nofill" or seq.fill.carry_all_rows or fill.value_rescale or fill.key_rescale:
        return None
    settings = repr((seq.fill.rows, seq.fill.hide_from, seq.fill.terminal_state))
    return fill_identity(seq.fill.arm, fill.split, maps_digest, policy, seq.prompt_ids, settings)


def _file_digest(path) -> str:
    """A map file's content hash: two files of one name are two fills."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_terminal_shift(spec, split: int, maps) -> None:
    """The terminal-state correction needs a ΔM for every recurrent layer above the split."""
    late = [layer for layer in spec.recurrent_layers if layer >= split]
    if not late:
        raise ValueError("fill.corrections.terminal_state: this model has no recurrent layer above the split")
    missing = [layer for layer in late if maps is None or layer not in maps.terminal]
    if missing:
        where = maps.path if maps is not None else "the map file"
        raise ValueError(
            f"fill.corrections.terminal_state: {where} holds no ΔM for layers {missing} "
            "(fit it with `ridgefill fit --terminal-state`)"
        )


def carries_late_state(spec, split: int) -> bool:
    """Whether a recurrent layer sits at or above the split: then the late sweep walks every row."""
    return any(layer >= split for layer in spec.recurrent_layers)


def token_table(tokenizer, rows: RowsConfig) -> TokenTable | None:
    """The per-token facts the selectors read; None when there is no tokenizer."""
    if tokenizer is None or not hasattr(tokenizer, "token_type"):
        return None
    counts = load_counts(rows.unigram) if rows.unigram else None
    return TokenTable.from_tokenizer(tokenizer, counts)
