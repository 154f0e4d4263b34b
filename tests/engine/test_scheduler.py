"""Scheduler policy on CPU with no model: budgets, chunking, decode-first, preemption."""

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.manager import CacheManager
from ridgefill_runtime.config import SchedulerConfig
from ridgefill_runtime.scheduler import Scheduler, StepResult
from ridgefill_runtime.sequence import SamplingParams, Sequence, SeqStatus


def make(budget=64, chunk=32, max_seqs=8, blocks=64, block_size=4):
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, chunk_size=chunk)
    return Scheduler(config, CacheManager(BlockManager(blocks, block_size), max_seqs))


def seq(n, max_tokens=4, **kw):
    return Sequence(prompt_ids=list(range(1, n + 1)), params=SamplingParams(max_tokens=max_tokens, temperature=0, **kw))


def fake_step(sched, token=7):
    items = sched.schedule()
    result = StepResult(
        next_tokens=[[token] if it.samples else None for it in items], prompt_logprobs=[None] * len(items)
    )
    sched.postprocess(items, result, eos_ids=(2,))
    return items


def test_long_prompt_is_chunked_and_budget_respected():
    s = make(budget=40, chunk=32)
    a = seq(100)
    s.add(a)
    sizes = []
    while a.num_computed < 100:
        items = fake_step(s)
        assert sum(i.num_tokens for i in items) <= 40
        sizes.append(items[0].num_tokens)
    assert sizes == [32, 32, 32, 4]
    assert a.output_ids == [7]  # sampled only when the prompt's last row ran


def test_decodes_go_first_and_prefill_takes_the_rest():
    s = make(budget=10, chunk=32)
    users = [seq(3, max_tokens=50) for _ in range(3)]
    for u in users:
        s.add(u)
    fake_step(s)  # all three prefills fit: 9 tokens
    assert all(len(u.output_ids) == 1 for u in users)
    newcomer = seq(100)
    s.add(newcomer)
    items = fake_step(s)
    assert [i.seq for i in items[:3]] == users and all(i.num_tokens == 1 for i in items[:3])
    assert items[3].seq is newcomer and items[3].num_tokens == 7  # what the budget leaves


def test_prefill_budget_with_decodes_caps_prompt_rows_only_beside_decodes():
    config = SchedulerConfig(max_num_batched_tokens=64, chunk_size=32, prefill_budget_with_decodes=10)
    s = Scheduler(config, CacheManager(BlockManager(64, 4), config.max_num_seqs))
    first = seq(40, max_tokens=50)
    s.add(first)
    assert [i.num_tokens for i in fake_step(s)] == [32]  # no decodes yet: the chunk as usual
    assert [i.num_tokens for i in fake_step(s)] == [8]
    late, newcomer = seq(30), seq(30)
    s.add(late)
    s.add(newcomer)
    items = fake_step(s)  # first decodes: 10 prompt rows at most beside it, split as the budget leaves them
    assert items[0].seq is first and items[0].num_tokens == 1
    assert [(i.seq, i.num_tokens) for i in items[1:]] == [(late, 10)]
    while not first.finished:
        items = fake_step(s)
        assert sum(i.num_tokens for i in items if i.start < len(i.seq.prompt_ids)) <= 10
    assert late.output_ids and newcomer.output_ids


def test_max_tokens_and_eos_finish_and_free_blocks():
    s = make()
    a, b = seq(5, max_tokens=3), seq(5, max_tokens=10)
    s.add(a)
    s.add(b)
    for _ in range(3):
        fake_step(s)
    assert a.finished and a.finish_reason == "length" and a.block_table == []
    fake_step(s, token=2)  # EOS
    assert b.finished and b.finish_reason == "stop"
    assert s.blocks.num_free == s.blocks.num_blocks


def test_max_num_seqs_limits_admission():
    s = make(max_seqs=2)
    seqs = [seq(3) for _ in range(3)]
    for q in seqs:
        s.add(q)
    fake_step(s)
    assert [q.status for q in seqs] == [SeqStatus.RUNNING, SeqStatus.RUNNING, SeqStatus.WAITING]


def test_out_of_blocks_preempts_newest_and_recomputes():
    # 6 blocks of 4 slots: two prompts of 12 tokens fill them exactly; the next decode needs a 7th.
    s = make(blocks=6, block_size=4, budget=64)
    a, b = seq(12, max_tokens=5), seq(12, max_tokens=5)
    s.add(a)
    s.add(b)
    fake_step(s)
    items = fake_step(s)
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.block_table == []
    assert [i.seq for i in items] == [a]
    while not a.finished:
        fake_step(s)
    # b comes back and recomputes prompt + its first output token before decoding on
    items = fake_step(s)
    assert items[0].seq is b and items[0].num_tokens == 13
    while not b.finished:
        fake_step(s)
    assert len(b.output_ids) == 5 and s.blocks.num_free == 6


def test_abort_frees_blocks():
    s = make()
    a = seq(20)
    s.add(a)
    fake_step(s)
    s.finish(a, "abort")
    assert a.finished and a.finish_reason == "abort" and s.blocks.num_free == s.blocks.num_blocks
    assert not s.has_work()
