"""Frozen, validated configuration objects. Each setting is read in exactly one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .errors import ModelLoadError


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

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


PREFIX_CACHING = ("auto", "on", "off")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots each."""

    block_size: int = 16
    kv_cache_gib: float = 1.0  # memory the K/V slabs may take when num_blocks is not given
    num_blocks: int | None = None  # explicit pool size; overrides kv_cache_gib
    # reuse the K/V of full blocks another request computed (cache/prefix_cache.py): "auto" where the
    # model's caches are K/V only (not recurrent or looped models), "on" (refused elsewhere), "off"
    prefix_caching: str = "auto"
    # what the K/V slabs hold: "auto" the model's dtype; a narrower one halves the cache (and what a
    # decode step reads of it), each key and value rounded once when written
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"cache.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.prefix_caching not in PREFIX_CACHING:
            raise ValueError(
                f"cache.prefix_caching must be one of {', '.join(PREFIX_CACHING)}, got {self.prefix_caching!r}"
            )
        if self.block_size <= 0:
            raise ValueError(f"cache.block_size must be positive, got {self.block_size}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"cache.kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"cache.num_blocks must be positive, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step token budget and concurrency; chunk_size caps one prompt's share of a step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    chunk_size: int = 512
    # The most prompt rows a step takes when it also carries decodes (0: only max_num_batched_tokens
    # bounds them). Such a step lasts as long as its prompt rows make it, so this bounds every running
    # user's inter-token latency, at the cost of longer prefills while others decode.
    prefill_budget_with_decodes: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"scheduler.{name} must be positive, got {getattr(self, name)}")
        if self.prefill_budget_with_decodes < 0:
            raise ValueError(
                f"scheduler.prefill_budget_with_decodes must be >= 0 (0: no cap), "
                f"got {self.prefill_budget_with_decodes}"
            )


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

    loops: int | None = None
    cache: str = "ripe"
    window: int = 64
    block: int = 4
    draft_loops: int = 4
    allow_short_window: bool = False

    def __post_init__(self) -> None:
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
class SpeculativeConfig:
    """Speculative decoding for greedy requests: each decode step verifies up to `num_tokens`
    drafted tokens in one multi-row step. "ngram" (prompt lookup) drafts the continuation of
    the longest suffix of the sequence's own tokens, `min_ngram`..`max_ngram` long, that
    occurred earlier in it. min_ngram defaults to 2: a one-token match (" the") drafts mostly
    wrong tokens, rows each step pays for and rejects."""

    method: str = "off"
    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 2

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            if getattr(self, name) < 1:
                raise ValueError(f"speculative.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"speculative.min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF folder or GGUF file; None: the embedded default
    dtype: str = "float32"
    device: str = "cpu"
    # How a GGUF's quantized linear weights are held: "packed" keeps their blocks and multiplies
    # with the weight-only kernel (ops/packed_linear.py; CPU), "dequantized" expands them to
    # `dtype`, "auto" packs where the kernel exists (a dense family on the CPU with the extension).
    weights: str = "auto"
    # On a CUDA device, decode steps replay CUDA graphs captured at start-up, one per batch size
    # (decode_graphs.py); False runs every step eagerly (vLLM's enforce_eager). The CPU ignores it.
    cuda_graphs: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fill: FillConfig = field(default_factory=lambda: FillConfig())
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    looped: LoopConfig = field(default_factory=LoopConfig)  # read only for looped models

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")


WEIGHT_MODES = ("auto", "packed", "dequantized")
FILL_ARMS = ("exact", "nofill", "identity", "ridgefill")
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

    selectors: tuple[str, ...] = ("special",)
    attention_share: float = 0.10
    attention_layers: tuple[int, ...] = (3, 7, 11)
    window: int = 64
    probe_window: int = 256
    budget_factor: float = 1.0
    base_attention_share: float = 0.20
    protected_share: float = 0.25
    lexical_cap: float = 0.05
    lexical_sentence_rows: int = 80
    unigram: str | None = None  # token counts over the calibration text (protected, probe)
    control: str = "none"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "selectors", tuple(self.selectors))
        object.__setattr__(self, "attention_layers", tuple(self.attention_layers))
        bad = [s for s in self.selectors if s not in SELECTORS]
        if bad:
            raise ValueError(f"fill.rows.selectors: unknown selector {bad[0]!r} (known: {', '.join(SELECTORS)})")
        if self.control not in CONTROLS:
            raise ValueError(f"fill.rows.control must be one of {', '.join(CONTROLS)}, got {self.control!r}")
        for name in ("attention_share", "base_attention_share", "protected_share", "lexical_cap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"fill.rows.{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("window", "probe_window", "lexical_sentence_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"fill.rows.{name} must be >= 1, got {getattr(self, name)}")
        if self.budget_factor < 0:
            raise ValueError(f"fill.rows.budget_factor must be >= 0, got {self.budget_factor}")
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
    x̂_l = x_S), ridgefill (x̂_l = A_l x_S + b_l from `maps`).
    """

    arm: str = "exact"
    split: int = 15
    tail: int = 1024
    maps: str | None = None  # map file; required by the ridgefill arm
    placement: str = "resident"  # where maps live: device memory, or pinned host memory streamed per layer
    value_rescale: bool = False
    key_rescale: bool = False
    rescale_rows: int = 64  # c: first exact late rows on which the rescale ratios are measured
    # hybrids: add ρ_l·ΔM_l to each late Gated DeltaNet layer's state at the prefix's end (seed 000
    # §2.3); ΔM comes with the maps (`ridgefill fit --terminal-state`)
    terminal_state: bool = False
    rows: RowsConfig = field(default_factory=RowsConfig)  # exact prefix rows
    # what a filled request takes from the prefix cache (cache/prefix_cache.py): "reselect" (cached
    # filled blocks; its own selectors choose its exact rows again, and chosen rows the cache holds
    # filled are remade exact), "as-is" (cached blocks and their exact rows unchanged, new exact
    # rows only among the rows it computes) or "never" (filled blocks serve only the
    # byte-identical request again)
    reuse_filled: str = "reselect"

    def __post_init__(self) -> None:
        if self.arm not in FILL_ARMS:
            raise ValueError(f"fill.arm must be one of {', '.join(FILL_ARMS)}, got {self.arm!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"fill.placement must be resident or streamed, got {self.placement!r}")
        if self.split < 1:
            raise ValueError(f"fill.split must be >= 1, got {self.split}")
        if self.tail < 1:
            raise ValueError(f"fill.tail must be >= 1 (the last prompt row is always exact), got {self.tail}")
        if self.reuse_filled not in REUSE_POLICIES:
            raise ValueError(f"fill.reuse_filled must be one of {', '.join(REUSE_POLICIES)}, got {self.reuse_filled!r}")
        if self.rescale_rows < 1:
            raise ValueError(f"fill.rescale_rows must be >= 1, got {self.rescale_rows}")
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
