"""A filled sequence preempted in the middle of its two-sweep prefill (its lower sweep, its probe,
its late sweep's exact rows, its tail) gives back every cache it holds (KV blocks, its state
slot, its split-state stash) while it waits, and still answers as it does when nothing
preempts it."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.dense import DenseLM
from ridgefill_runtime.sequence import SamplingParams, Sequence, SeqStatus
from ridgefill_runtime.stages import Stage
from tiny_models import build_tiny

BLOCK, POOL_BLOCKS = 4, 24  # 96 positions: the old sequence's decode must take the young one's blocks
OLD_PROMPT, OLD_NEW = 20, 40
YOUNG_PROMPT, YOUNG_NEW = 60, 4
FILL = FillConfig(arm="identity", split=1, tail=8, rows=RowsConfig(selectors=("probe",), probe_window=4))
EXACT_ROWS = [0, 5, 17, 31]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_gqa_untied")
    build_tiny("llama_gqa_untied", folder)
    ckpt = load_hf_folder(folder)
    return DenseLM(ckpt.config, ckpt.tensors)


def engine(model, num_blocks: int, block_size: int = BLOCK) -> Engine:
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        fill=FILL,
        scheduler=SchedulerConfig(chunk_size=2, max_num_batched_tokens=64, max_num_seqs=4),
    )
    eng = Engine(model, None, config)
    eng.scheduler.select = lambda seq: list(EXACT_ROWS)  # NOTE: fixed rows: the rerun chooses the same
    return eng


def prompts(model):
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size
    return (
        torch.randint(0, vocab, (OLD_PROMPT,), generator=g).tolist(),
        torch.randint(0, vocab, (YOUNG_PROMPT,), generator=g).tolist(),
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def alone(model, ids, n: int, fill: bool, block_size: int = BLOCK) -> list[int]:
    eng = engine(model, 256, block_size)
    seq = eng.add_request(ids, greedy(n), fill=fill)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().preemptions_total == 0
    return seq.output_ids


def test_preempted_prefill_gives_every_cache_back(model):
    old_ids, young_ids = prompts(model)
    eng = engine(model, POOL_BLOCKS)
    states = eng.caches.states
    old = eng.add_request(old_ids, greedy(OLD_NEW), fill=False)
    eng.step()  # the old one runs first, so the young one is the newest: it gives way
    young = eng.add_request(young_ids, greedy(YOUNG_NEW))
    seen_stash = preempted_in = None
    while eng.has_unfinished():
        stage, slot = young.fill.stage, young.state_slot
        before = eng.stats().preemptions_total
        eng.step()
        if slot is not None and states.stash(slot) is not None:
            seen_stash = eng.stats().stash_bytes
        if eng.stats().preemptions_total > before and preempted_in is None:
            preempted_in = stage
            check_waiting_holds_nothing(eng, young, old)
    # NOTE: this pool runs dry during the lower sweep; the later stages are preempted below
    assert preempted_in is Stage.LOWER, f"the young sequence was preempted in {preempted_in}, not its lower sweep"
    assert seen_stash and seen_stash >= YOUNG_PROMPT * model.config.hidden_size * 4
    assert young.fill.exact_rows == EXACT_ROWS
    assert old.output_ids == alone(model, old_ids, OLD_NEW, fill=False)
    assert young.output_ids == alone(model, young_ids, YOUNG_NEW, fill=True)
    end = eng.stats()
    assert (end.kv_blocks_used, end.state_slots_used, end.stash_bytes) == (0, 0, 0)
    assert states.stash_bytes() == 0


def check_waiting_holds_nothing(eng: Engine, young, old) -> None:
    """While it waits, the preempted sequence holds no block, no slot and no stash."""
    stats, states = eng.stats(), eng.caches.states
    assert young.status is SeqStatus.WAITING and young.block_table == [] and young.state_slot is None
    assert stats.kv_blocks_used == len(old.block_table)
    assert stats.state_slots_used == 1 and old.state_slot is not None
    # NOTE: the old sequence is not filled: any stash left would be the young one's
    assert stats.stash_bytes == 0 and states.stash_bytes() == 0
    assert all(states.stash(s) is None for s in range(states.num_slots))


# NOTE: the middle row of each later stage: probe_window 4 probe rows, the 4 exact rows, the
# 8-row tail (FILL.tail), reached at chunk boundaries (chunk_size 2).
LATER_STAGES = [("probe", 2), ("exact rows", 2), ("tail", 4)]


def progress(seq: Sequence) -> tuple[str, int]:
    """Which part of its prefill seq runs next and how many of that part's rows are done."""
    if seq.fill.stage is Stage.PROBE:
        return "probe", seq.fill.queue_done
    if seq.fill.stage is Stage.LATE and seq.fill.queue_done < len(seq.fill.exact_rows):
        return "exact rows", seq.fill.queue_done
    if seq.fill.stage is Stage.LATE:
        return "tail", seq.fill.queue_done - len(seq.fill.exact_rows)
    return str(seq.fill.stage), seq.num_computed


def take_free_blocks(eng: Engine) -> list[int]:
    """Empty the pool, as a burst of other work would: the next block anyone needs must come
    from preempting the newest running sequence."""
    hog: list[int] = []
    eng.blocks.grow(hog, eng.blocks.num_free * eng.blocks.block_size)
    return hog


@pytest.mark.parametrize("part, done", LATER_STAGES)
def test_prefill_preempted_mid_later_stage_gives_every_cache_back(model, part, done):
    old_ids, young_ids = prompts(model)
    # NOTE: one position per block, so the old sequence's every decode step needs a block:
    # emptying the pool preempts the young one at exactly the step chosen
    eng = engine(model, 256, block_size=1)
    states = eng.caches.states
    old = eng.add_request(old_ids, greedy(OLD_NEW), fill=False)
    eng.step()
    young = eng.add_request(young_ids, greedy(YOUNG_NEW))
    while progress(young) != (part, done):
        assert not young.fill.stage.done, f"the young sequence never reached row {done} of its {part}"
        eng.step()
    assert eng.stats().preemptions_total == 0 and old.fill.stage.done and not old.finished
    assert states.stash(young.state_slot) is not None  # there is a stash to give back
    assert eng.stats().stash_bytes >= YOUNG_PROMPT * model.config.hidden_size * 4
    hog = take_free_blocks(eng)
    eng.step()  # the old sequence's decode takes its block from the young one
    eng.blocks.free(hog)
    assert eng.stats().preemptions_total == 1, f"the young sequence was not preempted at row {done} of its {part}"
    check_waiting_holds_nothing(eng, young, old)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().preemptions_total == 1
    assert young.fill.exact_rows == EXACT_ROWS
    assert old.output_ids == alone(model, old_ids, OLD_NEW, fill=False, block_size=1)
    assert young.output_ids == alone(model, young_ids, YOUNG_NEW, fill=True, block_size=1)
    end = eng.stats()
    assert (end.kv_blocks_used, end.state_slots_used, end.stash_bytes) == (0, 0, 0)
    assert states.stash_bytes() == 0
