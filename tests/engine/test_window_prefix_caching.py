"""Prefix caching on sliding-window models (tiny Gemma 3, window 16, blocks of 4) through the
real engine, window-bounded pages on: a request that starts from cached blocks answers as it
does alone on an engine without the cache (greedy tokens identical, the log-probability of
every sampled token within 1e-5 of its size), for shared system prompts, hits
that end mid-window and at block ends, three-turn chats, and concurrency with preemption and
aborts on a small pool; every page returns. The hits are real: tokens found are counted, and a
hit past the window reads pages that its own sequence let go of while it ran.
"""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny
from prefix_workloads import concurrent_with_aborts
from prefix_workloads import drain as _drain

BLOCK = 4


@pytest.fixture(scope="module", params=["gemma3_sliding", "gemma3_two_global"])
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny(request.param, folder)
    return folder


def _engine(folder, prefix_caching: str, num_blocks: int = 400, max_num_seqs: int = 8, fill=None):
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix_caching),
        fill=fill or FillConfig(),
        scheduler=SchedulerConfig(chunk_size=8, max_num_batched_tokens=64, max_num_seqs=max_num_seqs),
    )
    return build_engine(config)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)


def _alone(folder, prompt: list[int], n: int):
    """The reference: the same request alone on an engine without the prefix cache."""
    engine = _engine(folder, "off")
    seq = engine.add_request(prompt, _greedy(n))
    _drain(engine)
    return seq


def _same_as_alone(folder, seq) -> None:
    ref = _alone(folder, seq.prompt_ids, seq.params.max_tokens)
    assert seq.output_ids == ref.output_ids
    got = torch.tensor([t.logprob for t in seq.logprobs.output])
    want = torch.tensor([t.logprob for t in ref.logprobs.output])
    # NOTE: relative: a hit changes where prefill chunks start, so sums run in another order
    assert ((got - want).abs() / want.abs().clamp_min(1.0)).max() < 1e-5


def _all_pages_back(engine) -> None:
    assert engine.stats().kv_blocks_used == 0


def test_auto_turns_the_cache_on_with_window_bounded_pages(folder):
    engine = _engine(folder, "auto")
    assert engine.prefix_caching and engine.caches.layout is not None


def test_shared_system_prompt_one_after_another(folder):
    """A 70-token system prompt (past four windows), questions of several lengths, so hits end
    at block ends and the prompts' last tokens fall anywhere in a block. The first request let
    go of the pages the hits read while it ran on: they were found as cache entries."""
    engine = _engine(folder, "on")
    system = _tokens(70, 1)
    seqs = []
    for i, extra in enumerate((6, 9, 1, 14, 3)):
        seqs.append(engine.add_request(system + _tokens(extra, 10 + i), _greedy(12)))
        _drain(engine)
    for seq in seqs[1:]:
        assert seq.prefix.num_cached >= 68  # the system prompt's full blocks
    assert engine.stats().prefix_hit_tokens_total >= 4 * 68
    for seq in seqs:
        _same_as_alone(folder, seq)
    _all_pages_back(engine)


def test_three_turn_chat_hits_through_each_answer(folder):
    """Each turn's prompt is the last one, its answer and a new message: the hit runs through
    the answer, whose last window's pages were cached when the turn ended."""
    engine = _engine(folder, "on")
    prompt, turns = _tokens(30, 2), []
    for t in range(3):
        seq = engine.add_request(prompt, _greedy(24))
        _drain(engine)
        turns.append(seq)
        prompt = prompt + seq.output_ids + _tokens(7, 20 + t)
    assert turns[1].prefix.num_cached >= len(turns[0].prompt_ids) + 24 - BLOCK - 1
    assert turns[2].prefix.num_cached >= len(turns[1].prompt_ids) + 24 - BLOCK - 1
    for seq in turns:
        _same_as_alone(folder, seq)
    _all_pages_back(engine)


def test_concurrent_requests_with_preemption_and_aborts_on_a_small_pool(folder):
    """Requests on three shared prefixes arrive while others run, on a pool too small for all of
    them at once; some are aborted mid-run. Every finished one answers as it does alone."""
    engine = _engine(folder, "on", num_blocks=22, max_num_seqs=4)  # 88 positions in every group
    done = concurrent_with_aborts(engine, _tokens, 40, 17, 12, (16, 30), 40)
    stats = engine.stats()
    assert stats.preemptions_total > 0 and stats.prefix_hit_tokens_total > 0
    for seq in done:
        _same_as_alone(folder, seq)
    _all_pages_back(engine)


@pytest.mark.parametrize("policy", ["reselect", "as-is"])
def test_filled_requests_stay_out_of_the_cache_and_exact_ones_still_hit(folder, policy):
    """On a window layout a filled prefill keeps its late pages lazy (window_kv_memory.md), so its
    blocks are not published and it takes no hit: it answers as a fresh fill does, and its pages
    follow the late sweep as with the cache off."""
    fill = FillConfig(arm="identity", split=1, tail=8, rows=RowsConfig(selectors=("special",)), reuse_filled=policy)
    engine = _engine(folder, "on", fill=fill)
    assert engine.runner.planner.defer_windows
    fresh = _engine(folder, "off", fill=fill)
    doc = _tokens(60, 3)
    got = []
    for i in range(2):
        prompt = doc + _tokens(9, 50 + i)
        got.append(engine.add_request(prompt, _greedy(8)))
        _drain(engine)
        want = fresh.add_request(prompt, _greedy(8))
        _drain(fresh)
        assert got[-1].output_ids == want.output_ids and got[-1].fill.boundary > 0
    assert got[1].prefix.num_cached == 0
    exact = engine.add_request(doc + [5], _greedy(4), fill=False)
    _drain(engine)
    exact_again = engine.add_request(doc + [6], _greedy(4), fill=False)
    _drain(engine)
    assert exact.prefix.num_cached == 0 and exact_again.prefix.num_cached == 60
    _all_pages_back(engine)
