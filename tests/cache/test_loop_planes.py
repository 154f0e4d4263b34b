"""The loop-plane cache kinds of a looped model (seed 001 §2, Eq. (3) and (10)): what the pools
really allocate equals the paper's memory formulas, and Huginn-0125's dimensions give Table 2."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.cache.build import CacheBudget, build_caches
from ridgefill_runtime.cache.spec import AttentionCache, CacheSpec, LoopPlanesCache

BLOCK = 16


def looped_spec(
    n_pre: int, n_core: int, n_coda: int, loops: int, heads: int, dim: int, kind: str, window: int, dtype: torch.dtype
) -> CacheSpec:
    """Prelude and coda layers keep ordinary K/V; each core layer keeps its loops' planes."""
    att = AttentionCache(heads, dim)
    core = LoopPlanesCache(heads, dim, loops, kind, window)
    return CacheSpec((att,) * n_pre + (core,) * n_core + (att,) * n_coda, dtype)


def allocated_bytes(spec: CacheSpec, length: int) -> int:
    """Bytes the pools hold for one sequence of `length` positions: every K/V slab and ring."""
    caches = build_caches(spec, CacheBudget(block_size=BLOCK, num_blocks=length // BLOCK, state_slots=1), "cpu")
    slabs = [*caches.kv.k.values(), *caches.kv.v.values()]
    rings = [t for parts in caches.states.rings.values() for t in parts.values()]
    return sum(t.numel() * t.element_size() for t in slabs + rings)


@pytest.mark.parametrize("length", [256, 1024])
@pytest.mark.parametrize("kind, window", [("full", 0), ("deepest", 0), ("ripe", 16), ("ripe", 64)])
def test_allocated_bytes_equal_eq3_and_eq10(length, kind, window):
    n_pre, n_core, n_coda, loops, heads, dim = 2, 3, 1, 5, 2, 8
    spec = looped_spec(n_pre, n_core, n_coda, loops, heads, dim, kind, window, torch.bfloat16)
    b = 2 * heads * dim * 2  # bytes per layer per token, bf16 (K and V)
    m_full = b * length * (n_pre + n_coda + loops * n_core)  # Eq. (3)
    m_deep = b * length * (n_pre + n_coda + n_core)
    want = {"full": m_full, "deepest": m_deep, "ripe": m_deep + b * n_core * (loops - 1) * min(window, length)}[
        kind
    ]  # Eq. (10)
    assert allocated_bytes(spec, length) == want
    assert spec.kv_bytes_per_token() * length + spec.state_bytes_per_sequence() == want


def test_huginn_dimensions_give_table_2():
    """Huginn-0125: 2 prelude, 4 core layers looped R = 32 times, 2 coda; 55 heads of width 96, bf16;
    L = 1024, MB = 10^6 bytes: 2,855 / 173 / 215 / 341 / 843 MB."""
    table = {}
    for name, kind, window in (
        ("full", "full", 0),
        ("deepest", "deepest", 0),
        ("W=16", "ripe", 16),
        ("W=64", "ripe", 64),
        ("W=256", "ripe", 256),
    ):
        spec = looped_spec(2, 4, 2, 32, 55, 96, kind, window, torch.bfloat16)
        table[name] = round((spec.kv_bytes_per_token() * 1024 + spec.state_bytes_per_sequence()) / 1e6)
    assert table == {"full": 2855, "deepest": 173, "W=16": 215, "W=64": 341, "W=256": 843}


def test_planes_are_keyed_by_layer_and_loop_and_a_freed_slot_clears_its_ring():
    spec = looped_spec(1, 2, 1, 3, 1, 4, "ripe", 2, torch.float32)
    assert spec.paged_keys == (0, (1, 3), (2, 3), 3)  # the deepest plane only, per core layer
    assert looped_spec(1, 1, 1, 3, 1, 4, "full", 0, torch.float32).paged_keys == (0, (1, 1), (1, 2), (1, 3), 2)
    caches = build_caches(spec, CacheBudget(block_size=BLOCK, num_blocks=2, state_slots=2), "cpu")
    ring = caches.states.rings[1]["k"]  # [slots, W, R-1, Hkv, D]
    assert ring.shape == (2, 2, 2, 1, 4)
    ring.fill_(1.0)
    caches.states.free_slot(0)
    assert ring[0].abs().sum() == 0 and bool((ring[1] == 1).all())


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(kind="ring"), "loop cache kind must be one of full, deepest, ripe, got 'ring'"),
        (dict(kind="deepest", window=4), "a window W >= 0 is for kind 'ripe' only"),
        (dict(kind="ripe", window=-1), "a window W >= 0 is for kind 'ripe' only"),
        (dict(loops=0), "loop planes need positive heads, head_dim and loops"),
    ],
)
def test_bad_loop_caches_are_refused_naming_the_setting(kwargs, words):
    args = dict(num_kv_heads=1, head_dim=4, loops=4) | kwargs
    with pytest.raises(ValueError, match=words):
        LoopPlanesCache(**args)


def test_the_served_spec_of_huginn_0125_gives_table_2():
    """The same table from the runtime's own path: Huginn-0125's config.json keys parsed by the
    huginn_raven family, the looped model's cache spec for each [looped] cache setting."""
    from ridgefill_runtime.config import LoopConfig
    from ridgefill_runtime.models.huginn import HUGINN_RAVEN
    from ridgefill_runtime.models.looped import loop_cache_spec

    raw = {
        "model_type": "huginn_raven",
        "n_embd": 5280,
        "n_heads": 55,
        "num_key_value_heads": 55,
        "intermediate_size": 17920,
        "n_layers_in_prelude": 2,
        "n_layers_in_recurrent_block": 4,
        "n_layers_in_coda": 2,
        "mean_recurrence": 32,
        "vocab_size": 65536,
        "block_size": 4096,
        "rope_base": 50000,
        "qk_bias": True,
        "tie_embeddings": True,
        "injection_type": "linear",
    }
    cfg = HUGINN_RAVEN.config_from_hf(raw, {}, "config.json")
    table = {}
    for name, kind, window in (
        ("full", "full", 0),
        ("deepest", "deepest", 0),
        ("W=16", "ripe", 16),
        ("W=64", "ripe", 64),
        ("W=256", "ripe", 256),
    ):
        spec = loop_cache_spec(cfg, LoopConfig(cache=kind, window=window, block=0), torch.bfloat16)
        table[name] = round((spec.kv_bytes_per_token() * 1024 + spec.state_bytes_per_sequence()) / 1e6)
    assert table == {"full": 2855, "deepest": 173, "W=16": 215, "W=64": 341, "W=256": 843}
