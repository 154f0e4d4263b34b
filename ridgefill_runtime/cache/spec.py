"""What a model keeps per layer between steps, declared by the model, sized by build_caches.

A model family says, layer by layer, which kind of cache the layer needs:
  - AttentionCache: paged K/V, one entry per token position (grows with the sequence);
  - RecurrentCache: a fixed-size per-sequence state (e.g. a Gated DeltaNet layer's conv state
    and recurrent state), one slot per running sequence whatever its length;
  - LoopPlanesCache: a looped model's core layer, run R times per token (seed 001 §2): the
    K/V "planes" it keeps, per cache kind (full, deepest plane, RIPE with a window W).
On top of the layers, the two-sweep prefill keeps a split-state stash (N x d) per filled
sequence while it is in its prefill; CacheSpec.stash_width sizes it.

Plain frozen dataclasses: no tensors (the pools in kv_pool.py / state_pool.py hold those).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionCache:
    """Paged K/V: per token, one [num_kv_heads, head_dim] key and one value. A sliding-window
    layer (window > 0) is read only `window` positions back, so its old pages can be let go."""

    num_kv_heads: int
    head_dim: int
    window: int = 0

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"attention cache needs positive heads and head_dim, got {self}")
        if self.window < 0:
            raise ValueError(f"attention cache window must be >= 0, got {self.window}")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize


@dataclass(frozen=True)
class RecurrentCache:
    """A fixed-size state per sequence: one tensor of each shape in `parts` (e.g.
    (("conv", (k - 1, d_conv)), ("state", (heads, d_k, d_v))) for a Gated DeltaNet layer)."""

    parts: tuple[tuple[str, tuple[int, ...]], ...]
    # NOTE: a state that accumulates over the whole sequence (GDN's S) is kept in float32 even
    # when the model runs in bf16; None: the spec's cache dtype.
    dtype: torch.dtype | None = None
    # Parts the model snapshots after every row of a speculative verification (StatePool.history),
    # so a rejected draft can be rolled back; empty: the layer cannot take multi-token steps.
    rollback_parts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a recurrent cache keeps at least one state tensor")
        names = [name for name, _ in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"recurrent state part names must be unique, got {names}")
        for name, shape in self.parts:
            if not shape or any(n <= 0 for n in shape):
                raise ValueError(f"recurrent state part {name!r} needs a positive shape, got {shape}")
        unknown = set(self.rollback_parts) - set(names)
        if unknown:
            raise ValueError(f"rollback parts {sorted(unknown)} are not state parts {names}")

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return sum(math.prod(shape) for _, shape in self.parts) * (self.dtype or dtype).itemsize


LOOP_CACHE_KINDS = ("full", "deepest", "ripe")


@dataclass(frozen=True)
class LoopPlanesCache:
    """A core layer of a looped model, whose loop r = 1..R emits K/V for every token (plane r).

    full     every plane of every position, paged (seed 001 Eq. (3));
    deepest  plane R only, paged (Eq. (3)'s M_deep);
    ripe     plane R paged for every position, plus a per-sequence ring holding planes
             1..R-1 of the `window` most recent positions (Eq. (10)).
    Paged planes live in the KV pool under the keys (layer, plane); the ring in the state pool."""

    num_kv_heads: int
    head_dim: int
    loops: int
    kind: str = "full"
    window: int = 0  # W, for kind "ripe"

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.head_dim <= 0 or self.loops <= 0:
            raise ValueError(f"loop planes need positive heads, head_dim and loops, got {self}")
        if self.kind not in LOOP_CACHE_KINDS:
            raise ValueError(f"loop cache kind must be one of {', '.join(LOOP_CACHE_KINDS)}, got {self.kind!r}")
        if self.window < 0 or (self.kind != "ripe" and self.window):
            raise ValueError(f"a window W >= 0 is for kind 'ripe' only, got {self.kind!r} with W = {self.window}")

    @property
    def paged_planes(self) -> tuple[int, ...]:
        """The planes kept for every position (1-based loop numbers)."""
        return tuple(range(1, self.loops + 1)) if self.kind == "full" else (self.loops,)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return len(self.paged_planes) * 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    @property
    def ring_shape(self) -> tuple[int, ...] | None:
        """[W, R-1, Hkv, D] per sequence, for K and for V; None without a ring."""
        if self.kind != "ripe" or self.window == 0 or self.loops == 1:
            return None
        return (self.window, self.loops - 1, self.num_kv_heads, self.head_dim)

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        return 0 if self.ring_shape is None else 2 * math.prod(self.ring_shape) * dtype.itemsize


LayerCache = AttentionCache | RecurrentCache | LoopPlanesCache


@dataclass(frozen=True)
class CacheSpec:
    """Per layer, what it keeps (`layers[i]` for layer i), in the model's cache dtype."""

    layers: tuple[LayerCache, ...]
    dtype: torch.dtype
    stash_width: int = 0  # split-state width (hidden size) of the fill's stash; 0: no fill possible

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a cache spec needs at least one layer")
        geometry = {
            (c.num_kv_heads, c.head_dim) for c in self.layers if isinstance(c, (AttentionCache, LoopPlanesCache))
        }
        # NOTE: one K/V slab shape for every attention layer keeps one block table per sequence
        # valid across layers; mixed geometries would need per-group pools (vLLM's KV cache groups).
        if len(geometry) > 1:
            raise ValueError(f"attention layers must share one K/V geometry, got {sorted(geometry)}")
        if self.stash_width < 0:
            raise ValueError(f"stash_width must be >= 0, got {self.stash_width}")

    @classmethod
    def dense(cls, config, dtype: torch.dtype) -> CacheSpec:
        """Every layer attends (Llama, Qwen3): what a model without its own cache_spec() keeps."""
        window_of = config.family_config.window_of
        layers = tuple(
            AttentionCache(config.num_kv_heads, config.head_dim, window_of(i)) for i in range(config.num_layers)
        )
        return cls(layers=layers, dtype=dtype, stash_width=config.hidden_size)

    def first_layers(self, n: int) -> CacheSpec:
        """The spec of layers 0..n-1 only (a run that stops early needs no later cache)."""
        return CacheSpec(self.layers[:n], self.dtype, self.stash_width)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.layers) if isinstance(c, AttentionCache))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.layers) if isinstance(c, RecurrentCache))

    @property
    def loop_layers(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.layers) if isinstance(c, LoopPlanesCache))

    @property
    def windowed(self) -> bool:
        """Some attention layer is a sliding-window one (its out-of-window pages can go)."""
        return any(isinstance(c, AttentionCache) and c.window for c in self.layers)

    @property
    def paged_keys(self) -> tuple:
        """The KV pool's slabs: an attention layer's index, or (layer, plane) for loop planes."""
        keys: list = []
        for i, c in enumerate(self.layers):
            if isinstance(c, AttentionCache):
                keys.append(i)
            elif isinstance(c, LoopPlanesCache):
                keys += [(i, plane) for plane in c.paged_planes]
        return tuple(keys)

    @property
    def attention(self) -> AttentionCache | None:
        """The (shared) K/V geometry of the layers that attend; None when none does."""
        found = next((c for c in self.layers if isinstance(c, (AttentionCache, LoopPlanesCache))), None)
        return None if found is None else AttentionCache(found.num_kv_heads, found.head_dim)

    def kv_bytes_per_token(self) -> int:
        return sum(
            c.bytes_per_token(self.dtype) for c in self.layers if isinstance(c, (AttentionCache, LoopPlanesCache))
        )

    @property
    def rolls_back(self) -> bool:
        """Every recurrent layer snapshots its state per verified row: multi-token steps are safe."""
        return all(c.rollback_parts for c in self.layers if isinstance(c, RecurrentCache))

    @property
    def prefix_cacheable(self) -> bool:
        """A cached prefix can be resumed: its blocks' K/V, and for recurrent layers (and a RIPE
        store's ring) a snapshot of their states after the last of those blocks (snapshots.py).
        Not a deepest-plane looped store (prefix_cache.loop_identity says why)."""
        return not any(isinstance(c, LoopPlanesCache) and c.kind == "deepest" for c in self.layers)

    def snapshot_bytes(self) -> int:
        """What one snapshot of every per-sequence state a prefix hit resumes takes: recurrent
        states and RIPE rings (0: none)."""
        return sum(
            c.bytes_per_sequence(self.dtype) for c in self.layers if isinstance(c, (RecurrentCache, LoopPlanesCache))
        )

    def why_not_prefix_cacheable(self) -> str:
        # NOTE: a deepest-plane prefill reads its own chunk's rows at loop r and older rows at
        # the deepest plane, so its planes depend on where chunks start
        return (
            f"layers {list(self.loop_layers)} keep only the deepest loop plane, whose prefill depends on where "
            'chunks start, so a cached prefix would change the output; use cache.prefix_caching = "off" '
            '(or looped.cache = "full" or "ripe")'
        )

    def state_bytes_per_sequence(self) -> int:
        return sum(
            c.bytes_per_sequence(self.dtype) for c in self.layers if isinstance(c, (RecurrentCache, LoopPlanesCache))
        )

    def stash_bytes_per_row(self) -> int:
        return self.stash_width * self.dtype.itemsize


def spec_of(model, looped=None) -> CacheSpec:
    """The model's declared cache spec; a model that declares none attends in every layer.
    `looped` (config.LoopConfig): the loop planes an operator chose to store for a looped model."""
    declared = getattr(model, "cache_spec", None)
    if not callable(declared):
        return CacheSpec.dense(model.config, model.dtype)
    return declared(looped) if model.config.family_config.looped else declared()
