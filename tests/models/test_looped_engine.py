"""Looped models through the engine: greedy output against the float64 reference, self-speculative
decoding (Algorithm 1) against sequential decoding at identical greedy output, mixed with other
users' requests, preemption and abort; and the engine's refusals."""

from __future__ import annotations

import pytest

from ridgefill_runtime.config import (
    CacheConfig,
    EngineConfig,
    LoopConfig,
    LoopOverrides,
    SchedulerConfig,
    SpeculativeConfig,
)
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams

from looped_reference import TINY_HUGINN, LoopedReference, write_tiny_huginn

PROMPTS = [[5, 7, 9, 11, 3], [4, 4, 8, 1, 9, 33, 12, 40], [17, 23, 5, 5, 5, 5, 9, 30, 31, 12, 6, 8]]
NEW = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("huginn")
    return folder, write_tiny_huginn(folder)


def engine(folder, looped: LoopConfig, blocks: int = 64, **kw):
    return build_engine(EngineConfig(model=str(folder), looped=looped, cache=CacheConfig(num_blocks=blocks), **kw))


def run(eng, prompts, params):
    seqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [s.output_ids for s in seqs], seqs


GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


def reference_greedy(tensors, prompt, loops=4):
    ref = LoopedReference(tensors, TINY_HUGINN, loops)
    for t in prompt:
        logits = ref.step(t)
    out = []
    for _ in range(NEW):
        out.append(int(logits.argmax()))
        logits = ref.step(out[-1])
    return out


def test_full_cache_greedy_equals_reference(tiny):
    folder, tensors = tiny
    outs, _ = run(engine(folder, LoopConfig(cache="full", block=0)), PROMPTS, GREEDY)
    assert outs == [reference_greedy(tensors, p) for p in PROMPTS]


@pytest.mark.parametrize("cache,window,block", [("full", 0, 2), ("full", 0, 4), ("ripe", 4, 4), ("ripe", 8, 2)])
def test_self_speculation_keeps_greedy_output(tiny, cache, window, block):
    folder, _ = tiny
    looped = dict(cache=cache, window=window, draft_loops=2)
    sequential, _ = run(engine(folder, LoopConfig(block=0, **looped)), PROMPTS, GREEDY)
    eng = engine(folder, LoopConfig(block=block, **looped))
    spec, seqs = run(eng, PROMPTS, GREEDY)
    assert spec == sequential
    assert eng.scheduler.spec.steps > 0 and all(s.spec.verifications > 0 for s in seqs)
    assert (
        sum(s.spec.verified_tokens for s in seqs)
        == sum(s.spec.verifications for s in seqs) + eng.scheduler.spec.accepted
    )


def test_speculating_beside_other_users_and_under_preemption(tiny):
    """Greedy requests speculate while sampled ones (seeded) decode one token at a time, in the
    same steps; a cache too small for all of them preempts and recomputes; every slot comes back."""
    folder, _ = tiny
    looped = LoopConfig(cache="ripe", window=6, block=3, draft_loops=2)
    alone = [run(engine(folder, looped), [p], GREEDY)[0][0] for p in PROMPTS]
    sampled = SamplingParams(max_tokens=NEW, temperature=0.8, seed=7, ignore_eos=True)
    alone_sampled = run(engine(folder, looped), [PROMPTS[0]], sampled)[0][0]
    eng = engine(folder, looped, blocks=6, scheduler=SchedulerConfig(max_num_batched_tokens=16, chunk_size=5))
    seqs = [eng.add_request(p, GREEDY) for p in PROMPTS] + [eng.add_request(PROMPTS[0], sampled)]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs] == alone + [alone_sampled]
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert (
        eng.scheduler.caches.num_free_slots == eng.scheduler.caches.num_state_slots
        and not eng.caches.states.pending_from
    )


def test_abort_mid_speculation_gives_everything_back(tiny):
    folder, _ = tiny
    eng = engine(folder, LoopConfig(cache="ripe", window=4, block=4, draft_loops=2))
    seq = eng.add_request(PROMPTS[1], GREEDY)
    for _ in range(4):
        eng.step()
    eng.abort(seq)
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.caches.states.pending_from


@pytest.mark.parametrize(
    "asked,field",
    [
        (LoopOverrides(loops=0), "ridgefill.loops"),
        (LoopOverrides(loops=5), "ridgefill.loops"),
        (LoopOverrides(draft_loops=4), "ridgefill.draft_loops"),
        (LoopOverrides(block=8, window=4), "ridgefill.window"),
        (LoopOverrides(block=1000000), "ridgefill.block"),  # was blamed on the server's window
        (LoopOverrides(cache="half"), "ridgefill.cache"),
        (LoopOverrides(cache="full"), "ridgefill.cache"),
        (LoopOverrides(window=16), "ridgefill.window"),
    ],
)
def test_bad_loop_settings_are_refused_naming_the_field(tiny, asked, field):
    folder, _ = tiny
    eng = engine(folder, LoopConfig(cache="ripe", window=8, block=4, draft_loops=2))
    with pytest.raises(InputError, match=field.replace(".", r"\.")):
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0, looped=asked))
    assert not eng.has_unfinished()


def test_a_short_window_is_served_only_when_asked(tiny):
    folder, _ = tiny
    with pytest.raises(ValueError, match="allow_short_window"):
        LoopConfig(cache="ripe", window=2, block=4)
    eng = engine(folder, LoopConfig(cache="ripe", window=2, block=4, draft_loops=2, allow_short_window=True))
    outs, _ = run(eng, PROMPTS[:1], GREEDY)
    assert len(outs[0]) == NEW


def test_operator_table_is_checked_against_the_model(tiny):
    folder, _ = tiny
    with pytest.raises(ValueError, match="looped.draft_loops"):
        engine(folder, LoopConfig(draft_loops=4, block=2))  # R = 4 (mean_recurrence)
    with pytest.raises(ValueError, match="speculative.method"):
        engine(folder, LoopConfig(block=2, draft_loops=2), speculative=SpeculativeConfig(method="ngram"))


def test_per_request_loops_and_policy(tiny):
    """A request runs its own R and reads a full store under its own policy: equal to the
    reference at that R and policy."""
    folder, tensors = tiny
    eng = engine(folder, LoopConfig(cache="full", block=0))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, looped=LoopOverrides(loops=3))
    outs, _ = run(eng, PROMPTS[:1], params)
    assert outs[0] == reference_greedy(tensors, PROMPTS[0], loops=3)
