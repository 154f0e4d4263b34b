"""Prefix caching on a looped model (tiny huginn_raven, 4 loops, blocks of 4), run in float64.

A hit takes the cached planes (every plane with the full store, the deepest with RIPE) and, with
RIPE, restores the ring of the window's recent planes from a snapshot taken after the hit's last
block. The request answers as it does alone with the cache off: greedy tokens identical and the
log-probability of every sampled token within 3e-7 of its size (the engine reports them as
float32; the model runs in float64). NOTE: float64, because in float32
this random tiny model amplifies rounding through its loops: alone with the cache off, RIPE(6)
prefills chunked 4 and 7 rows differ by up to 0.08 in log-probability and can pick other greedy
tokens, while in float64 they agree with the token-by-token reference to 2e-9 (seed 001
Proposition 1). Shared prompts, three-turn chats, preemption and aborts, with and without
self-speculation. Requests of other loop counts or seeds share nothing; deepest-plane reads take
no hit, and a deepest-plane store leaves the cache off under "auto".
"""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, LoopConfig, LoopOverrides, SchedulerConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams

from looped_reference import write_tiny_huginn
from prefix_workloads import concurrent_with_aborts
from prefix_workloads import drain as _drain

BLOCK = 4
TOL = 3e-7  # NOTE: the engine reports log-probabilities as float32: two float32 steps
STORES = {
    "full": LoopConfig(cache="full", block=0),
    "ripe": LoopConfig(cache="ripe", window=6, block=0),
    "ripe, speculating": LoopConfig(cache="ripe", window=6, block=3, draft_loops=2),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("huginn")
    write_tiny_huginn(folder)
    return folder


def _engine(folder, looped: LoopConfig, prefix: str = "on", num_blocks: int = 128, seqs: int = 8):
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix, snapshot_every=1)
    scheduler = SchedulerConfig(chunk_size=8, max_num_batched_tokens=64, max_num_seqs=seqs)
    config = EngineConfig(model=str(folder), dtype="float64", looped=looped, cache=cache, scheduler=scheduler)
    return build_engine(config)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0, **kw)


def _same_as_alone(folder, looped, seq) -> None:
    engine = _engine(folder, looped, "off")
    ref = engine.add_request(seq.prompt_ids, seq.params)
    _drain(engine)
    assert seq.output_ids == ref.output_ids
    got = torch.tensor([t.logprob for t in seq.logprobs.output], dtype=torch.float64)
    want = torch.tensor([t.logprob for t in ref.logprobs.output], dtype=torch.float64)
    assert ((got - want).abs() / want.abs().clamp_min(1.0)).max() <= TOL


def _all_back(engine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0


@pytest.mark.parametrize("store", sorted(STORES))
def test_shared_prompt_and_three_turn_chat(folder, store):
    looped = STORES[store]
    engine = _engine(folder, looped)
    system = _tokens(30, 1)
    seqs = []
    for i, extra in enumerate((5, 7, 2)):
        seqs.append(engine.add_request(system + _tokens(extra, 10 + i), _greedy(12)))
        _drain(engine)
    assert all(s.prefix.num_cached == 28 for s in seqs[1:])  # the shared full blocks
    prompt = _tokens(17, 2)
    for t in range(3):
        seqs.append(engine.add_request(prompt, _greedy(12)))
        _drain(engine)
        prompt = prompt + seqs[-1].output_ids + _tokens(5, 20 + t)
    if looped.block:  # NOTE: a verification rolls the ring back after its step: it snapshots nothing
        assert seqs[-1].prefix.num_cached >= (len(seqs[-2].prompt_ids) - 1) // BLOCK * BLOCK
    else:  # every decode step ending on a block end left one
        assert seqs[-1].prefix.num_cached >= len(seqs[-2].prompt_ids) + 12 - 2 * BLOCK
    if store.startswith("ripe"):
        assert engine.stats().prefix_state_restores_total >= 4  # the ring came from a snapshot
    for seq in seqs:
        _same_as_alone(folder, looped, seq)
    _all_back(engine)


def test_other_loops_and_seeds_share_nothing_and_deepest_reads_take_no_hit(folder):
    engine = _engine(folder, STORES["ripe"])
    doc = _tokens(24, 3)
    first = engine.add_request(doc + [1], _greedy(4))
    _drain(engine)
    fewer = engine.add_request(doc + [2], _greedy(4, looped=LoopOverrides(loops=3)))
    _drain(engine)
    seeded = engine.add_request(doc + [3], _greedy(4, seed=7))
    _drain(engine)
    narrower = engine.add_request(doc + [4], _greedy(4, looped=LoopOverrides(window=3)))
    _drain(engine)
    deepest = engine.add_request(doc + [5], _greedy(4, looped=LoopOverrides(window=0)))
    _drain(engine)
    again = engine.add_request(doc + [6], _greedy(4))
    _drain(engine)
    assert first.prefix.num_cached == fewer.prefix.num_cached == seeded.prefix.num_cached == 0
    assert narrower.prefix.num_cached == 0
    assert deepest.prefix.num_cached == 0 and deepest.prefix.identity is None
    assert again.prefix.num_cached == 24
    _same_as_alone(folder, STORES["ripe"], again)


def test_a_deepest_plane_store_leaves_the_cache_off(folder, caplog):
    deepest = LoopConfig(cache="deepest", block=0)
    with caplog.at_level("WARNING", logger="ridgefill.engine"):
        engine = _engine(folder, deepest, prefix="auto")
    assert not engine.prefix_caching and "where chunks start" in caplog.text
    with pytest.raises(ValueError, match="where chunks start"):
        _engine(folder, deepest, prefix="on")


@pytest.mark.parametrize("store", ["full", "ripe, speculating"])
def test_concurrency_with_preemption_and_aborts(folder, store):
    looped = STORES[store]
    engine = _engine(folder, looped, num_blocks=30, seqs=4)
    done = concurrent_with_aborts(engine, _tokens, 30, 13, 9, (12, 24), 60)
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    for seq in done:
        _same_as_alone(folder, looped, seq)
    _all_back(engine)
