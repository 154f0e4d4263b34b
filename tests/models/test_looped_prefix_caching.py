"""Prefix caching on a looped model (tiny huginn_raven, 4 loops, blocks of 4). With the full
store a hit takes every cached plane, and the request answers as it does alone with the cache off:
greedy tokens identical, and each sampled token's log-probability within the chunked-prefill
bound of this model. NOTE: measured, that bound is wide: the random tiny model amplifies float32
rounding through its loops, so alone with the cache off, prefills chunked 8 and 4 rows differ by
2e-4 to 9e-3 of a log-probability's size (and once in ten prompts in a greedy token), and the
concurrent workload below, run with the cache off, differs from each request alone by up to
3.4e-3. Hence 2e-3 alone and 5e-3 under concurrency; the cache-on gaps measured were 4e-5 to
3.2e-3. Shared prompts,
three-turn chats, preemption and aborts, with and without self-speculation. Requests of other
loop counts or seeds never share planes; RIPE and deepest-plane reads take no hit, and a RIPE
store leaves the cache off under "auto" (their planes depend on where prefill chunks start).
"""

from __future__ import annotations

import random

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, LoopConfig, LoopOverrides, SchedulerConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams

from looped_reference import write_tiny_huginn

BLOCK = 4
STORES = {
    "full": LoopConfig(cache="full", block=0),
    "full, speculating": LoopConfig(cache="full", block=3, draft_loops=2),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("huginn")
    write_tiny_huginn(folder)
    return folder


def _engine(folder, looped: LoopConfig, prefix: str = "on", num_blocks: int = 128, seqs: int = 8, chunk: int = 8):
    cache = CacheConfig(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix)
    scheduler = SchedulerConfig(chunk_size=chunk, max_num_batched_tokens=64, max_num_seqs=seqs)
    return build_engine(EngineConfig(model=str(folder), looped=looped, cache=cache, scheduler=scheduler))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0, **kw)


def _drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _same_as_alone(folder, looped, seq, tol: float) -> None:
    """Greedy tokens equal to the request's alone with the cache off, and each sampled token's
    log-probability within `tol` of its size there."""
    engine = _engine(folder, looped, "off")
    ref = engine.add_request(seq.prompt_ids, seq.params)
    _drain(engine)
    assert seq.output_ids == ref.output_ids
    got = torch.tensor([t.logprob for t in seq.logprobs.output])
    want = torch.tensor([t.logprob for t in ref.logprobs.output])
    assert ((got - want).abs() / want.abs().clamp_min(1.0)).max() <= tol


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
    assert seqs[-1].prefix.num_cached >= len(seqs[-2].prompt_ids) + 12 - 2 * BLOCK
    for seq in seqs:
        _same_as_alone(folder, looped, seq, 2e-3)
    _all_back(engine)


def test_other_loops_and_seeds_do_not_share_planes_and_other_policies_take_none(folder):
    engine = _engine(folder, STORES["full"])
    doc = _tokens(24, 3)
    first = engine.add_request(doc + [1], _greedy(4))
    _drain(engine)
    fewer = engine.add_request(doc + [2], _greedy(4, looped=LoopOverrides(loops=3)))
    _drain(engine)
    seeded = engine.add_request(doc + [3], _greedy(4, seed=7))
    _drain(engine)
    deepest = engine.add_request(doc + [4], _greedy(4, looped=LoopOverrides(cache="ripe", window=0)))
    _drain(engine)
    ripe = engine.add_request(doc + [6], _greedy(4, looped=LoopOverrides(cache="ripe", window=3)))
    _drain(engine)
    again = engine.add_request(doc + [5], _greedy(4))
    _drain(engine)
    assert first.prefix.num_cached == fewer.prefix.num_cached == seeded.prefix.num_cached == 0
    for other in (deepest, ripe):
        assert other.prefix.num_cached == 0 and other.prefix.identity is None
    assert again.prefix.num_cached == 24
    _same_as_alone(folder, STORES["full"], again, 2e-3)


def test_a_ripe_store_leaves_the_cache_off(folder, caplog):
    with caplog.at_level("WARNING", logger="ridgefill.engine"):
        engine = _engine(folder, LoopConfig(cache="ripe", window=6, block=0), prefix="auto")
    assert not engine.prefix_caching
    assert "prefill chunks" in caplog.text
    with pytest.raises(ValueError, match="prefill chunks"):
        _engine(folder, LoopConfig(cache="ripe", window=6, block=0), prefix="on")


def test_concurrency_with_preemption_and_aborts(folder):
    looped = STORES["full, speculating"]
    rng = random.Random(0)
    bases = [_tokens(30, 30 + i) for i in range(3)]
    engine = _engine(folder, looped, num_blocks=30, seqs=4)
    seqs, aborted = [], []
    for i in range(10):
        ids = rng.choice(bases)[: rng.randint(13, 30)] + _tokens(rng.randint(1, 9), 60 + i)
        seqs.append(engine.add_request(ids, _greedy(rng.randint(12, 24))))
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if i in (3, 7):
            live = [s for s in seqs if not s.finished]
            aborted.append(live[-1])
            engine.abort(live[-1])
    _drain(engine)
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    for seq in seqs:
        if seq not in aborted:
            _same_as_alone(folder, looped, seq, 5e-3)
    _all_back(engine)
