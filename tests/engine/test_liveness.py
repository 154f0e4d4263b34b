"""Liveness of the real Scheduler over random workloads, with a fake runner (no model):
every request finishes within a bounded number of steps, every step schedules something
while work exists, and every KV block comes back.

Sequences are built the way Engine.add_request builds them (apply_fill, then Scheduler.add),
so filled prompts walk the lower, probe and late stages with scattered exact rows.
"""

from __future__ import annotations

import random

import pytest

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.kv_layout import KVLayout
from ridgefill_runtime.cache.manager import CacheManager
from ridgefill_runtime.cache.snapshots import SnapshotTable
from ridgefill_runtime.cache.window_pages import WindowPages
from ridgefill_runtime.config import REUSE_POLICIES, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.engine import apply_fill, cache_identity
from ridgefill_runtime.scheduler import Scheduler, StepResult
from ridgefill_runtime.sequence import SamplingParams, Sequence, SeqStatus

EOS = 2
NUM_CASES = 320
# The default pool (kv_cache_gib = 1) on the embedded SmolLM2-135M in float32:
# 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes = 46,080 bytes per token; 2**30 / (46,080 x 16).
DEFAULT_POOL_BLOCKS = 2**30 // (46_080 * 16)


def exact_rows(seq: Sequence) -> list[int]:
    """A few prefix rows, the same ones every time (a preempted sequence chooses again)."""
    rng = random.Random(seq.seq_id)
    return sorted(rng.sample(range(seq.fill.boundary), min(seq.fill.boundary, rng.randint(0, 6))))


def new_request(
    sched: Scheduler,
    prompt_len: int,
    max_tokens: int,
    fill: FillConfig | None = None,
    ignore_eos: bool = True,
    policy: str | None = None,
) -> Sequence:
    """As Engine.add_request does, after Engine.validate's bound; `policy`: the reuse_filled of a
    prefix-caching engine (None: no prefix caching). NOTE: every prompt repeats one token, so
    with prefix caching every request shares blocks with every other."""
    blocks = sched.blocks
    assert prompt_len + max_tokens <= blocks.num_blocks * blocks.block_size, "Engine.validate refuses it"
    seq = Sequence(
        prompt_ids=[5] * prompt_len, params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    )
    if fill is not None:
        apply_fill(seq, fill)
    if policy is not None:
        seq.prefix.identity = cache_identity(seq, fill or FillConfig(), "", policy)
        seq.prefix.reselect = policy == "reselect"
    sched.add(seq)
    return seq


def step(sched: Scheduler, rng: random.Random | None = None) -> list:
    """One step through a fake runner, checking the scheduler's invariants."""
    had_work = sched.has_work()
    items = sched.schedule()
    check_step(sched, items, had_work)
    tokens = [_token(it.seq, rng) if it.samples else None for it in items]
    runs = [None if t is None else [t] for t in tokens]
    sched.postprocess(items, StepResult(next_tokens=runs, prompt_logprobs=[None] * len(items)), eos_ids=(EOS,))
    return items


def _token(seq: Sequence, rng: random.Random | None) -> int | None:
    if seq.params.max_tokens == 0:
        return None  # a scoring request: the runner samples nothing
    return EOS if rng is not None and rng.random() < 0.02 else 7


def check_step(sched: Scheduler, items: list, had_work: bool) -> None:
    blocks, cfg = sched.blocks, sched.config
    assert items or not had_work, "nothing scheduled while work exists: the scheduler is wedged"
    assert sum(it.num_tokens for it in items) <= cfg.max_num_batched_tokens
    assert len({id(it.seq) for it in items}) == len(items), "a sequence scheduled twice in one step"
    assert len(sched.running) <= cfg.max_num_seqs
    for it in items:
        seq = it.seq
        assert seq.status is SeqStatus.RUNNING and it.num_tokens >= 1
        assert it.end <= len(seq.block_table) * blocks.block_size, "rows outside the sequence's blocks"
        assert it.end <= seq.num_tokens
        if it.positions is not None:
            assert it.positions == sorted(it.positions) and len(it.positions) == it.num_tokens
    held = [b for s in sched.running for b in s.block_table]
    assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
    # NOTE: with window pages a held page is mapped from exactly one held block
    pages = sched.caches.pages
    mapped = 0 if pages is None else sum(p >= 0 for b in set(held) for p in pages._pages.get(b, ()))
    assert len(set(held)) + mapped + blocks.num_free == blocks.num_blocks
    shared = {b for b in held if held.count(b) > 1}
    assert all(b in blocks._key_of for b in shared), "a block in two tables that is no cache entry"


def random_case(seed: int) -> dict:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    num_blocks = rng.randint(max(2, 8 // block_size), max(4, 320 // block_size))
    pool = num_blocks * block_size
    chunk = rng.choice([1, 3, 8, 16, 32, 64, 128])
    budget = rng.choice([1, 2, 7, 16, 48, 96, 256])
    max_seqs = rng.choice([1, 2, 3, 5, 8, 16])
    tail = rng.randint(1, 24)
    rows = RowsConfig(
        selectors=rng.choice([("special",), ("probe",), ("special", "probe")]), probe_window=rng.randint(1, 40)
    )
    fill = FillConfig(arm="identity", split=1, tail=tail, rows=rows) if rng.random() < 0.6 else None
    requests = []
    for _ in range(rng.randint(1, 9)):
        # NOTE: biased to long prompts: the wedges come from prompts that together outgrow the pool.
        prompt = rng.randint(max(1, pool // 3), pool - 1) if rng.random() < 0.6 else rng.randint(1, max(1, pool // 4))
        max_tokens = rng.randint(0, min(pool - prompt, 24))
        arrives = 0 if rng.random() < 0.5 else rng.randint(0, 60)
        requests.append(
            dict(
                prompt=prompt,
                max_tokens=max_tokens,
                arrives=arrives,
                fill=fill if rng.random() < 0.8 else None,
                ignore_eos=rng.random() < 0.7,
            )
        )
    return dict(
        block_size=block_size,
        num_blocks=num_blocks,
        chunk=chunk,
        budget=budget,
        max_seqs=max_seqs,
        requests=requests,
        abort_rate=rng.choice([0.0, 0.0, 0.01, 0.05]),
        rng=rng,
    )


def window_pages(case: dict, blocks: BlockManager) -> WindowPages:
    """A Gemma-3-like layout over layers 0-3, cut at a split of 2: global 0 and 2, windows on 1
    and 3 of a few blocks."""
    rng, bs = case["rng"], case["block_size"]
    w_low, w_late = rng.randint(1, 6 * bs), rng.randint(1, 6 * bs)
    layout = KVLayout(bs, ((0, (0,)), (0, (2,)), (w_low, (1,)), (w_late, (3,))), split=2)
    return WindowPages(layout, blocks, lambda g, bs, ps: None)


def run_case(case: dict, prefix_caching: bool = False, windows: bool = False, snapshots: bool = False) -> None:
    """windows: the pool holds a window layout's pages, 4 per block (window_pages()); snapshots:
    a recurrent model's prefix cache, whose hits end where a state snapshot was kept."""
    rng = case["rng"]
    config = SchedulerConfig(
        max_num_batched_tokens=case["budget"], max_num_seqs=case["max_seqs"], chunk_size=case["chunk"]
    )
    blocks = BlockManager(case["num_blocks"] * (4 if windows else 1), case["block_size"])
    pages = window_pages(case, blocks) if windows else None
    table = SnapshotTable(rng.randint(1, 6)) if snapshots else None
    every = rng.choice([0, 1, 3]) if snapshots else 0
    manager = CacheManager(
        blocks,
        config.max_num_seqs,
        prefix_caching=prefix_caching,
        window_pages=pages,
        snapshots=table,
        snapshot_every=every,
    )
    sched = Scheduler(config, manager, exact_rows)
    for r in case["requests"]:
        r["policy"] = rng.choice(REUSE_POLICIES) if prefix_caching else None
    pending = sorted(case["requests"], key=lambda r: r["arrives"])
    seqs: list[Sequence] = []
    # NOTE: generous: preempted sequences recompute, but the oldest running one never loses work.
    limit = 1000 + 40 * sum(r["prompt"] + r["max_tokens"] + r["arrives"] for r in pending)
    for n in range(limit):
        while pending and pending[0]["arrives"] <= n:
            r = pending.pop(0)
            seqs.append(new_request(sched, r["prompt"], r["max_tokens"], r["fill"], r["ignore_eos"], r["policy"]))
        if not pending and not sched.has_work():
            break
        live = [s for s in seqs if not s.finished]
        if live and rng.random() < case["abort_rate"]:
            sched.finish(rng.choice(live), "abort")
        step(sched, rng)
    else:
        pytest.fail(f"not done after {limit} steps: {len(sched.running)} running, {len(sched.waiting)} waiting")
    assert all(s.finished for s in seqs)
    assert sched.blocks.num_free == sched.blocks.num_blocks
    assert table is None or table.num_taken == 0, "a snapshot slot taken and never published or given back"
    for s in seqs:
        if s.finish_reason == "length":
            assert len(s.output_ids) == s.params.max_tokens
        else:
            assert s.finish_reason == "abort" or (s.finish_reason == "stop" and s.output_ids[-1] == EOS)


def test_random_workloads_always_finish_and_return_every_block():
    for seed in range(NUM_CASES):
        run_case(random_case(seed))


def test_random_workloads_sharing_every_prefix_always_finish_and_return_every_block():
    """The same workloads with prefix caching, every prompt a prefix of the longer ones: shared
    blocks, waits for blocks in flight, reselected rows copied before they are remade, eviction."""
    for seed in range(NUM_CASES):
        run_case(random_case(seed), prefix_caching=True)


def test_random_workloads_sharing_every_prefix_with_state_snapshots():
    """The same again for a recurrent model: prefill chunks end where snapshots are due, slots
    are taken, published, evicted and given back, and hits end at a snapshot."""
    for seed in range(NUM_CASES):
        run_case(random_case(seed), prefix_caching=True, snapshots=True)


def test_random_workloads_sharing_every_prefix_over_window_pages():
    """The same again on a sliding-window layout: a hit takes the window pages its next row
    reads, pages let go stay cache entries, and every page held is one a held block maps to."""
    for seed in range(NUM_CASES):
        run_case(random_case(seed), prefix_caching=True, windows=True)


def run_to_end(sched: Scheduler, seqs: list[Sequence], limit: int) -> int:
    for n in range(limit):
        if not sched.has_work():
            return n
        step(sched)
    pytest.fail(f"wedged: {len(sched.running)} running, {len(sched.waiting)} waiting after {limit} steps")


def test_three_long_prompts_outgrowing_a_128_block_pool_all_finish():
    """3 x 1,500 tokens on 128 blocks of 16 (2,048 slots): they were all prefilling at once, none
    could grow, and nothing decoded, so nothing was ever preempted."""
    sched = Scheduler(SchedulerConfig(), CacheManager(BlockManager(128, 16), SchedulerConfig().max_num_seqs))
    seqs = [new_request(sched, 1500, 8) for _ in range(3)]
    run_to_end(sched, seqs, 500)
    assert all(s.finish_reason == "length" and len(s.output_ids) == 8 for s in seqs)
    assert sched.blocks.num_free == 128


def test_four_7000_token_prompts_on_the_default_pool_all_finish():
    sched = Scheduler(
        SchedulerConfig(), CacheManager(BlockManager(DEFAULT_POOL_BLOCKS, 16), SchedulerConfig().max_num_seqs)
    )
    assert 4 * 7000 > DEFAULT_POOL_BLOCKS * 16 > 7000 + 16  # together too big, each fits alone
    seqs = [new_request(sched, 7000, 16) for _ in range(4)]
    run_to_end(sched, seqs, 2000)
    assert all(s.finish_reason == "length" and len(s.output_ids) == 16 for s in seqs)
    assert sched.blocks.num_free == DEFAULT_POOL_BLOCKS


def test_filled_prompts_with_probe_and_exact_rows_outgrowing_the_pool_all_finish():
    """The same wedge through the two-sweep prefill: lower chunks grow the tables, then the probe
    and the late sweep revisit scattered positions below each table's end."""
    fill = FillConfig(
        arm="identity", split=1, tail=100, rows=RowsConfig(selectors=("special", "probe"), probe_window=64)
    )
    config = SchedulerConfig(chunk_size=256, max_num_batched_tokens=512)
    sched = Scheduler(config, CacheManager(BlockManager(128, 16), config.max_num_seqs), exact_rows)
    seqs = [new_request(sched, 1500, 8, fill) for _ in range(3)]
    run_to_end(sched, seqs, 1000)
    assert all(s.finish_reason == "length" and s.fill.boundary == 1400 for s in seqs)
    assert sched.blocks.num_free == 128


def test_older_prefill_preempts_newer_decoders_and_drops_their_items():
    """An old prompt that cannot grow takes blocks back from a newer decoding sequence, and the
    step no longer carries the decode item of the sequence it preempted."""
    config = SchedulerConfig(chunk_size=8, max_num_batched_tokens=64)
    sched = Scheduler(config, CacheManager(BlockManager(6, 4), config.max_num_seqs))
    old, young = new_request(sched, 20, 2), new_request(sched, 3, 6)
    step(sched)  # old: rows 0-7 (2 blocks); young: its prompt (1 block) and a first token
    step(sched)  # young decodes in its block; old: rows 8-15 (4 blocks); 1 block free
    assert len(young.output_ids) == 2 and sched.blocks.num_free == 1
    items = step(sched)  # young's decode takes the last block first, then old needs it back
    assert young.status is SeqStatus.WAITING and young.block_table == [] and young.num_computed == 0
    assert [(it.seq, it.num_tokens) for it in items] == [(old, 4)] and sched.num_preemptions == 1
    run_to_end(sched, [old, young], 100)
    assert old.finish_reason == young.finish_reason == "length" and len(young.output_ids) == 6
