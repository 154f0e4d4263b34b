"""A request's life in the engine: its tokens, sampling settings and progress. No tensors."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field

from .config import LoopOverrides, LoopPlan, RowsConfig
from .errors import InputError
from .grammar.spec import GrammarSpec
from .stages import Stage

# Temperatures below this sample greedily (vLLM's rule): dividing float32 logits by a smaller one
# overflows them to inf, and the softmax of inf - inf is NaN. Such a temperature means argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5
# What torch.Generator.manual_seed accepts (a negative seed is taken modulo 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Most alternatives a request may ask per token (OpenAI's bound): each costs a top-k over the
# vocabulary and a little text per token on the way out.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """One chosen token under the model's raw distribution (log_softmax of the logits, before
    temperature, top-k or top-p): its log-probability and the row's most likely tokens, best
    first, as (id, logprob) pairs (as many as the request asked)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy
    top_k: int = 0  # 0 (or -1, as vLLM and llama.cpp write it) means off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: bool = False  # record log p(next prompt token) and the argmax per prompt row
    prompt_top_logprobs: int = 0  # with prompt_logprobs: also each prompt row's most likely tokens
    logprobs: int | None = None  # record each generated token's logprob and this many alternatives
    # NOTE: a per-request decoding option, carried here so it travels with the request:
    # most draft tokens a step may verify; None takes the engine's setting, 0 turns it off.
    speculative: int | None = None
    looped: LoopOverrides | None = None  # a looped model's loops / cache policy / self-speculation
    grammar: GrammarSpec | None = None  # structured output: every sampled token keeps to it

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise InputError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)  # "off" in vLLM's and llama.cpp's words
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, or -1 or 0 for off, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InputError("stop strings must be non-empty")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InputError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InputError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if not 0 <= self.prompt_top_logprobs <= MAX_LOGPROBS:
            raise InputError(f"prompt_top_logprobs must be in 0..{MAX_LOGPROBS}, got {self.prompt_top_logprobs}")
        if self.speculative is not None and self.speculative < 0:
            raise InputError(f"speculative must be >= 0 (0 turns it off), got {self.speculative}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class FillState:
    """The fill's per-request settings and two-sweep progress: engine.apply_fill sets, stages.py advances."""

    boundary: int = 0  # prompt rows [0, boundary) are filled with `arm`; 0 means no fill
    arm: str = "exact"
    # Hybrids (seed 000 §2.4 "Two sweeps"): a late recurrent layer's state must be carried over
    # every prefix row in order, so the late sweep walks every position, not just the exact rows.
    carry_all_rows: bool = False
    terminal_state: bool = False  # add ρ·ΔM to the late recurrent states at the prefix's end
    rows: RowsConfig | None = None  # exact-row selectors for this request
    hide_from: int | None = None  # question-hidden control: selectors see only positions < this
    # See stages.py: "lower" runs layers below the split for every row; "probe", "recover" and
    # "late" run the positions in `queue` (`queue_done` of them so far); "full" is an ordinary
    # sequence (no fill, or the fill is done).
    stage: Stage = Stage.FULL
    queue: list[int] = field(default_factory=list)
    queue_done: int = 0
    row_scores: dict[str, list[float]] = field(default_factory=dict)  # selector scores per prefix row
    exact_rows: list[int] = field(default_factory=list)  # prefix rows chosen to run exactly

    @property
    def pending(self) -> int:
        """Queued positions not yet run (0 outside the probe, recover and late stages)."""
        return len(self.queue) - self.queue_done if self.stage.queued else 0

    def restart(self) -> None:
        """Back to the start of the two-sweep prefill (the settings stay)."""
        self.stage = Stage.LOWER if self.boundary > 0 else Stage.FULL
        self.queue, self.queue_done = [], 0
        self.row_scores, self.exact_rows = {}, []


@dataclass
class PrefixState:
    """Prefix caching's per-request state: Engine.add_request, cache/ (keys) and stages.py (hits) write it."""

    # The identity its blocks are published and looked up under (None: it neither reads nor
    # publishes cache entries) and the keys of its table's published blocks
    identity: bytes | None = None
    block_keys: list[bytes] = field(default_factory=list)
    # What its last admission found: positions taken from the cache, how many of them had filled late K/V
    num_cached: int = 0
    cached_filled_rows: int = 0
    reselect: bool = False  # reuse_filled = "reselect": cached rows are remade to its own selection of exact rows
    remade_rows: list[int] = field(default_factory=list)  # the cached rows it remakes exact (stages.py, recover)
    restore: int | None = None  # a recurrent model's hit: the snapshot slot its first step loads (cache/snapshots.py)
    turn_snapshot: int | None = None  # its own snapshot slot, rewritten at each block end its decode reaches
    turn_block: int = 0  # the block that snapshot follows

    def restart(self) -> None:
        """Forget the last admission's cache hit (the identity and published keys stay)."""
        self.num_cached = self.cached_filled_rows = 0
        self.remade_rows = []


@dataclass
class Speculation:
    """Speculative decoding's per-request bound and counts: Engine.add_request and Scheduler.postprocess write it."""

    max_draft: int = 0  # most draft tokens a decode step verifies (0: no speculation)
    verifications: int = 0  # decode steps that verified a draft
    verified_tokens: int = 0  # tokens those steps emitted


@dataclass
class Logprobs:
    """The log-probabilities a request asked to get back: Scheduler.postprocess writes them (Engine trims at a stop)."""

    # score mode (params.prompt_logprobs): per prompt row i in [fill.boundary, len(prompt) - 1)
    prompt: list[float] = field(default_factory=list)  # log p(prompt token i + 1)
    prompt_argmax: list[int] = field(default_factory=list)
    # with params.prompt_top_logprobs: per scored prompt row, its most likely (id, logprob) pairs
    prompt_top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # with params.logprobs: one entry per output token, in order (kept across preemptions)
    output: list[TokenLogprobs] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """One request: its lifecycle fields at the top level, the rest in groups by concern, each
    group's docstring saying who writes it: `fill` the fill settings and the two-sweep prefill's
    progress (stages.py), `prefix` prefix caching's, `spec` speculative decoding's, `logprobs`
    what it records for its response.

    `loop` stays top-level rather than in `spec`: a looped model runs every step of the sequence
    by it (the loops, the read policy, prefill chunks of at most W + 1 rows), speculating or not;
    its `block` only seeds `spec.max_draft`. `logprobs` is a group rather than four top-level
    lists: they are the response's records, not state the engine runs on, written in one place
    and read together by the server and LLM.score, and `seq.logprobs.prompt` /
    `seq.logprobs.output` say which side of the sequence each describes (not to be confused
    with `params.logprobs`, how many alternatives to record)."""

    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None  # its row in the state pool (recurrent states, stash) while it runs
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout" | "error"
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() after which it ends with "timeout"
    text: str = ""  # detokenized output, kept by the detokenizer
    loop: LoopPlan | None = None  # a looped model's resolved loop settings; set at add
    fill: FillState = field(default_factory=FillState)
    prefix: PrefixState = field(default_factory=PrefixState)
    spec: Speculation = field(default_factory=Speculation)
    logprobs: Logprobs = field(default_factory=Logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Rows still to compute before the next token can be sampled (1: a decode step)."""
        return self.num_tokens - self.num_computed + self.fill.pending + (self.fill.stage is Stage.LOWER)

    def start_prefill(self) -> None:
        """(Re)start the prompt from nothing: after admission, or a recompute preemption."""
        self.num_computed = 0
        self.prefix.restart()
        self.fill.restart()

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end), prompt then output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
