"""The K/V pool bytes ever touched (what the soak subtracts from the RSS): the blocks ever handed
out, checked against a set of every block id a table or take() has held, and their bytes against
the model's shapes."""

from __future__ import annotations

import random

import torch

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.build import CacheBudget, build_caches
from ridgefill_runtime.cache.spec import AttentionCache, CacheSpec
from ridgefill_runtime.sequence import SamplingParams, Sequence


def test_touched_blocks_are_the_ids_ever_held():
    rng = random.Random(0)
    bm = BlockManager(40, 4)
    tables: list[list[int]] = []
    seen: set[int] = set()
    for step in range(2000):
        op = rng.random()
        if op < 0.45 and bm.num_free:
            table: list[int] = []
            bm.grow(table, rng.randint(1, min(bm.num_free, 6) * 4))
            tables.append(table)
        elif op < 0.6 and tables:
            table = rng.choice(tables)
            if table and bm.num_free:  # a held block published, so freeing it keeps a cache entry
                bm.publish(table[0], f"k{step}".encode(), ())
        elif tables:
            bm.free(tables.pop(rng.randrange(len(tables))))
        for table in tables:
            seen.update(table)
        assert bm.num_touched == len(seen)
    assert bm.evictions > 0  # cache entries were handed out again: they must not count twice
    assert bm.num_touched <= bm.num_blocks


def test_kv_touched_bytes_of_a_request():
    layers, heads, dim = 3, 2, 8
    spec = CacheSpec((AttentionCache(heads, dim),) * layers, torch.bfloat16)
    caches = build_caches(spec, CacheBudget(block_size=4, num_blocks=32, state_slots=2), "cpu")
    manager = caches.manager()
    per_token = 2 * layers * heads * dim * 2  # K and V of every layer, 2 bytes each
    seq = Sequence(prompt_ids=list(range(1, 11)), params=SamplingParams())
    manager.allocate(seq, 10)
    assert manager.stats().kv_touched_bytes == 3 * 4 * per_token  # 10 positions: 3 blocks of 4
    manager.free(seq)
    again = Sequence(prompt_ids=list(range(1, 5)), params=SamplingParams())
    manager.allocate(again, 4)
    assert manager.stats().kv_touched_bytes == 3 * 4 * per_token  # a freed block reused: nothing new
