"""Prefix caching on Gated DeltaNet hybrids (tiny Qwen3.5 and Qwen3-Next, blocks of 4): a hit
takes the cached attention K/V and restores every GDN layer's conv state and S from a snapshot
taken after the hit's last block, and the request answers as it does alone on an engine without
the cache (greedy tokens identical, each sampled token's log-probability within 1e-5 of its
size). Shared system prompts, hits that end at snapshot boundaries short of the shared prefix,
three-turn chats, few snapshot slots (eviction), concurrency with preemption and aborts.
Memory: snapshot bytes against the formula, taken from the K/V budget.
"""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.cache.build import CacheBudget, build_caches
from ridgefill_runtime.cache.spec import spec_of
from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import HYBRID_CONFIGS, build_tiny_hybrid
from prefix_workloads import concurrent_with_aborts
from prefix_workloads import drain as _drain

BLOCK = 4


@pytest.fixture(scope="module", params=sorted(HYBRID_CONFIGS))
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny_hybrid(request.param, folder)
    return folder


def _engine(
    folder, prefix="on", every=1, snapshots: int | None = 64, num_blocks=256, seqs=8, fill: FillConfig | None = None
):
    cache = CacheConfig(
        block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix, snapshot_every=every, state_snapshots=snapshots
    )
    scheduler = SchedulerConfig(chunk_size=8, max_num_batched_tokens=64, max_num_seqs=seqs)
    config = EngineConfig(model=str(folder), cache=cache, scheduler=scheduler, fill=fill or FillConfig())
    return build_engine(config)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


def _same_as_alone(folder, seq) -> None:
    engine = _engine(folder, "off")
    ref = engine.add_request(seq.prompt_ids, _greedy(seq.params.max_tokens))
    _drain(engine)
    assert seq.output_ids == ref.output_ids
    got = torch.tensor([t.logprob for t in seq.logprobs.output])
    want = torch.tensor([t.logprob for t in ref.logprobs.output])
    assert ((got - want).abs() / want.abs().clamp_min(1.0)).max() < 1e-5


def _all_back(engine) -> None:
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.state_slots_used == 0
    assert engine.scheduler.caches.snapshots.table.num_taken == 0


def test_auto_turns_the_cache_on_with_snapshots(folder):
    engine = _engine(folder, "auto", snapshots=None)
    assert engine.prefix_caching and engine.scheduler.caches.snapshots.table.num_slots > 0


@pytest.mark.parametrize("every", [1, 2, 0])
def test_shared_system_prompt_resumes_at_the_last_snapshot(folder, every):
    """A 70-token system prompt, then questions. With a snapshot every block the hit covers the
    prompt's 17 shared full blocks; every 2 blocks, 16 of them; with prompt ends only, the hit
    ends at the first request's prompt end when the second starts with all of it."""
    engine = _engine(folder, every=every)
    system = _tokens(70, 1)
    first = engine.add_request(system + _tokens(6, 10), _greedy(10))
    _drain(engine)
    second = engine.add_request(system + _tokens(9, 11), _greedy(10))
    _drain(engine)
    cut = engine.stats().prefix_state_cut_tokens_total  # for /metrics: cached, but no snapshot there
    assert cut == 68 - {1: 68, 2: 64, 0: 0}[every]
    third = engine.add_request(first.prompt_ids + first.output_ids[:3] + [7], _greedy(10))
    _drain(engine)
    want = {1: 68, 2: 64, 0: 0}[every]
    assert second.prefix.num_cached == want
    assert third.prefix.num_cached >= 72  # the first's prompt end (75 // 4 * 4) at least
    assert engine.stats().prefix_state_restores_total == (2 if want else 1)
    for seq in (first, second, third):
        _same_as_alone(folder, seq)
    _all_back(engine)


@pytest.mark.parametrize("every", [1, 32])
def test_three_turn_chat(folder, every):
    """With a snapshot every block, or only at prompt ends and (the default spacing of 32 blocks
    being past these prompts) the turn snapshot each sequence publishes when it ends."""
    engine = _engine(folder, every=every)
    prompt, turns = _tokens(30, 2), []
    for t in range(3):
        seq = engine.add_request(prompt, _greedy(20))
        _drain(engine)
        turns.append(seq)
        prompt = prompt + seq.output_ids + _tokens(7, 20 + t)
    for before, seq in zip(turns, turns[1:]):
        # the last block end the answer's decode reached left a snapshot: the hit runs into the answer
        assert seq.prefix.num_cached >= len(before.prompt_ids) + 20 - 2 * BLOCK
    for seq in turns:
        _same_as_alone(folder, seq)
    _all_back(engine)


def test_few_snapshot_slots_evict_and_hits_stay_correct(folder):
    engine = _engine(folder, every=1, snapshots=3)
    bases = [_tokens(40, 40 + i) for i in range(3)]
    seqs = []
    for i in range(6):
        seqs.append(engine.add_request(bases[i % 3] + _tokens(5, 50 + i), _greedy(6)))
        _drain(engine)
    assert engine.scheduler.caches.snapshots.table.evictions > 0
    for seq in seqs:
        _same_as_alone(folder, seq)
    _all_back(engine)


def test_concurrent_requests_with_preemption_and_aborts_on_a_small_pool(folder):
    engine = _engine(folder, every=2, num_blocks=40, seqs=4)
    done = concurrent_with_aborts(engine, _tokens, 40, 17, 12, (16, 30), 60)
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.prefix_state_restores_total > 0
    for seq in done:
        _same_as_alone(folder, seq)
    _all_back(engine)


@pytest.mark.parametrize("policy", ["reselect", "as-is"])
def test_a_filled_request_takes_no_hit_and_answers_as_a_fresh_fill(folder, policy, caplog):
    """A filled prefix's late recurrent states are approximate: a filled request computes its
    prompt under either reuse policy, so it answers as a fresh fill (cache off) does, and an exact
    request after it still resumes from the exact snapshots."""
    fill = FillConfig(arm="identity", split=2, tail=8, rows=RowsConfig(selectors=("special",)), reuse_filled=policy)
    with caplog.at_level("WARNING", logger="ridgefill.engine"):
        engine = _engine(folder, every=1, fill=fill)
    assert "filled requests take no cached blocks" in caplog.text  # said once, with the reason
    fresh = _engine(folder, "off", fill=fill)
    doc = _tokens(48, 5)
    engine.add_request(doc + [1], _greedy(4), fill=False)
    _drain(engine)
    got = []
    for tail in ([2, 9, 9], [3, 8]):
        got.append(engine.add_request(doc + tail, _greedy(6)))
        _drain(engine)
        want = fresh.add_request(doc + tail, _greedy(6))
        _drain(fresh)
        assert got[-1].fill.boundary > 0 and got[-1].prefix.num_cached == 0
        assert got[-1].output_ids == want.output_ids
        lp = torch.tensor([t.logprob for t in got[-1].logprobs.output])
        lp_want = torch.tensor([t.logprob for t in want.logprobs.output])
        assert ((lp - lp_want).abs() / lp_want.abs().clamp_min(1.0)).max() < 1e-5
    again = engine.add_request(doc + [3], _greedy(4), fill=False)
    _drain(engine)
    assert again.prefix.num_cached == 48
    _same_as_alone(folder, again)


def test_snapshot_memory_matches_the_formula_and_comes_out_of_the_kv_budget(folder):
    """One snapshot = every GDN layer's conv state ((kernel - 1) x conv channels), S (value heads
    x key dim x value dim) and the fill's two gate-product sums per value head, in float32."""
    engine = _engine(folder)
    cfg = HYBRID_CONFIGS[folder.name.rstrip("0123456789")]
    conv_channels = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + (
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    )
    per_layer = (
        (cfg["linear_conv_kernel_dim"] - 1) * conv_channels
        + cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"]
        + 2 * cfg["linear_num_value_heads"]
    )
    spec = spec_of(engine.model)
    assert spec.snapshot_bytes() == len(spec.recurrent_layers) * per_layer * 4
    held = sum(
        t.numel() * t.element_size() for parts in engine.caches.states.snapshots.values() for t in parts.values()
    )
    assert held == 64 * spec.snapshot_bytes()
    budget = CacheBudget(block_size=BLOCK, kv_cache_gib=0.01)
    plain = build_caches(spec, budget, "cpu").num_blocks
    with_snapshots = build_caches(spec, CacheBudget(block_size=BLOCK, kv_cache_gib=0.01, state_snapshots=100), "cpu")
    per_block = spec.kv_bytes_per_token() * BLOCK
    assert plain - with_snapshots.num_blocks == pytest.approx(100 * spec.snapshot_bytes() / per_block, abs=1)
