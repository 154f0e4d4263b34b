"""Window-bounded K/V (cache/kv_layout.py, cache/window_pages.py): sliding-window layers give back
the pages no later row can read, and nothing the model computes changes.

References: transformers' greedy tokens (full forward per step) on the same tiny Gemma 3 checkpoint
(window 16); the
same engine keeping every page (cache.window_bounded = false); and, for the
pages held, the definition itself: a window group keeps a block while one of its positions is at
or after (lowest position a later row may have) - window + 1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.kv_layout import KVLayout, window_layout
from ridgefill_runtime.cache.spec import AttentionCache, CacheSpec
from ridgefill_runtime.cache.window_pages import WindowPages
from ridgefill_runtime.fill.select import RowSelector
from ridgefill_runtime.fill.tokens import TokenTable
from ridgefill_runtime.config import (
    CacheConfig,
    EngineConfig,
    FillConfig,
    RowsConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny

WINDOW = 16  # the tiny gemma3_sliding config's
BLOCK = 4


@pytest.fixture(scope="module", params=["gemma3_sliding", "gemma3_two_global"])
def gemma(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, build_tiny(request.param, folder)


def _spec(windows: list[int]) -> CacheSpec:
    return CacheSpec(tuple(AttentionCache(2, 8, w) for w in windows), torch.float32)


def test_layout_cuts_layers_into_equal_groups_global_first():
    gemma_270m = [0 if i % 6 == 5 else 512 for i in range(18)]  # layers 5, 11, 17 global
    layout = window_layout(_spec(gemma_270m), 16)
    assert layout.group_size == 3 and layout.num_groups == 6
    assert layout.groups[0] == (0, (5, 11, 17))
    gemma_1b = [0 if i % 6 == 5 else 512 for i in range(26)]  # 4 global, 22 local
    layout = window_layout(_spec(gemma_1b), 16)
    assert layout.group_size == 2 and layout.windows == (0, 0) + (512,) * 11
    placed = sorted(layer for _, layers in layout.groups for layer in layers)
    assert placed == list(range(26))
    cut = window_layout(_spec(gemma_270m), 16, split=9)  # lower/late x global/local: 1, 2, 8, 7 layers
    assert cut.group_size == 1 and cut.num_groups == 18 and cut.windows[:3] == (0, 0, 0)
    assert all((layers[0] >= 9) == cut.late(g) for g, (_, layers) in enumerate(cut.groups))
    assert window_layout(_spec([0] * 4), 16) is None  # nothing to bound
    assert window_layout(_spec([8] * 4), 16) is None  # no global group to number blocks


def test_trim_keeps_exactly_the_blocks_a_later_row_can_read():
    # global layers 1 (lower) and 4 (late), local 0 (lower, window 6), 2 and 3 (late, windows 11, 6)
    layout = KVLayout(BLOCK, ((0, (1,)), (0, (4,)), (6, (0,)), (6, (3,)), (11, (2,))), split=2)
    windows = {1: 0, 2: 6, 3: 6, 4: 11}
    for reach in range(0, 41):
        for late_reach in (None, max(0, reach - 9), reach):
            blocks = BlockManager(128, BLOCK)
            mapped: dict[int, dict[int, int]] = {g: {} for g in windows}
            pages = WindowPages(layout, blocks, lambda g, bs, ps: mapped[g].update(zip(bs, ps)))
            table: list[int] = []
            blocks.grow(table, 40)
            pages.attach(table)
            pages.trim(table, reach, late_reach)
            for g, window in windows.items():
                lowest = late_reach if layout.late(g) else reach
                for i, block in enumerate(table):
                    seen = (
                        window == 0
                        or lowest is None
                        or any(p >= lowest - window + 1 for p in range(i * BLOCK, (i + 1) * BLOCK))
                    )
                    assert (mapped[g][block] >= 0) == seen, (reach, late_reach, g, i)
            held = sum(p >= 0 for g in windows for p in mapped[g].values())
            assert blocks.num_free == 128 - len(table) - held
            pages.release(table)
            blocks.free(table)
            assert blocks.num_free == 128


def _engine(
    folder,
    prefix_caching: str,
    num_blocks: int = 256,
    fill: FillConfig | None = None,
    speculative: SpeculativeConfig | None = None,
    chunk: int = 8,
    window_bounded: bool = True,
):
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(
            block_size=BLOCK, num_blocks=num_blocks, prefix_caching=prefix_caching, window_bounded=window_bounded
        ),
        scheduler=SchedulerConfig(chunk_size=chunk, max_num_batched_tokens=64, max_num_seqs=8),
        fill=fill or FillConfig(),
        speculative=speculative or SpeculativeConfig(),
    )
    return build_engine(config)


def _lowest_row(seq, late: bool) -> int | None:
    """The lowest position a later row of seq runs at, below the split or above it (None: not
    known yet: the exact prefix rows are chosen after the lower sweep)."""
    if not late or seq.fill.stage.done:
        return seq.num_computed
    if seq.fill.stage == "late" and seq.fill.queue_done < len(seq.fill.queue):
        return seq.fill.queue[seq.fill.queue_done]
    return None


def _expected_pages(engine) -> int:
    """Pages a window-bounded pool should hold now, from the definition."""
    layout = engine.scheduler.caches.pages.layout
    total = 0
    for seq in engine.scheduler.running:
        n = len(seq.block_table)
        total += n  # group 0 keeps every block
        for window, layers in layout.groups[1:]:
            lowest = _lowest_row(seq, layout.split > 0 and layers[0] >= layout.split)
            # the lowest key a later row reads (a global layer: the first)
            first = 0 if lowest is None or window == 0 else max(0, lowest - window + 1)
            total += sum((i + 1) * BLOCK - 1 >= first for i in range(n))
    return total


def _run(engine, prompts, params, check_pages: bool = False):
    """Run to the end; with check_pages, the pages held after every step against the definition
    (equal once every running sequence is past its prefill; in a two-sweep prefill the late window
    groups take pages only as the late sweep comes near, so at most that)."""
    seqs = [engine.add_request(p, params) for p in prompts]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        used = engine.stats().kv_blocks_used
        peak = max(peak, used)
        if check_pages and all(s.fill.stage.done for s in engine.scheduler.running):
            assert used == _expected_pages(engine)
        elif check_pages:
            assert used <= _expected_pages(engine)
    assert engine.stats().kv_blocks_used == 0  # every page back
    return seqs, peak


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (n,), generator=g).tolist() for n in lengths]


def test_bounded_engine_matches_transformers_and_the_unbounded_engine(gemma):
    folder, ref = gemma
    prompts = _prompts((40, 75, 130))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    bounded = _engine(folder, "off")
    assert bounded.caches.layout is not None and not bounded.prefix_caching
    full = _engine(folder, "off", window_bounded=False)
    assert full.caches.layout is None
    got, peak_bounded = _run(bounded, prompts, params, check_pages=True)
    want, _ = _run(full, prompts, params)
    for a, b, prompt in zip(got, want, prompts):
        assert a.output_ids == b.output_ids
        lp_a = torch.tensor([t.logprob for t in a.logprobs.output])
        lp_b = torch.tensor([t.logprob for t in b.logprobs.output])
        assert (lp_a - lp_b).abs().max() < 1e-5
        assert a.output_ids == _greedy_uncached(ref, prompt, 24)


def _greedy_uncached(ref, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward over everything so far.
    NOTE: not ref.generate: its cached path disagrees with its own full forward on this
    checkpoint for the 40-token prompt (second token 199 vs 202); the full forward is the definition."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_window_pages_let_more_sequences_run_without_preemption(gemma):
    """A pool that holds the four sequences' every-layer K/V only with preemptions holds their
    global K/V and the local windows at once."""
    folder, _ = gemma
    prompts = _prompts((120, 121, 122, 123), seed=5)  # + 40 tokens: 40-41 blocks each, 162 for all
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    bounded = _engine(folder, "off", num_blocks=100)
    full = _engine(folder, "off", window_bounded=False, num_blocks=100)
    got, _ = _run(bounded, prompts, params, check_pages=True)
    want, _ = _run(full, prompts, params)
    assert bounded.scheduler.num_preemptions == 0
    assert full.scheduler.num_preemptions > 0
    assert [s.output_ids for s in got] == [s.output_ids for s in want]


# exact prefix rows scattered through the prefix: the attention selector reads the lower (windowed)
# layer 0, the probe the late layers, so both measure attention over windowed, trimmed caches
ROWS = RowsConfig(
    selectors=("special", "attention", "probe"),
    attention_layers=(0,),
    window=8,
    probe_window=8,
    attention_share=0.15,
    base_attention_share=0.15,
)
# the tiny checkpoint has no tokenizer: a plain vocabulary of words, all equally common
SELECT = RowSelector(TokenTable(tuple(f" w{i}" for i in range(320)), frozenset(), (10,) * 320))


def test_filled_prefill_pages_and_outputs(gemma):
    """Below the split the lower sweep lets old pages go as it moves on; above it the pages wait
    until the exact prefix rows are chosen, then follow the late sweep's queue; the fill writes a
    filled row's windowed K/V only once a late row reaches it. Outputs equal the engine that keeps
    every page and writes every filled row (the prefix cache needs both)."""
    folder, ref = gemma
    split = ref.config.num_hidden_layers // 2  # 1 of 3 layers, 2 of 4 (a global layer each side)
    fill = FillConfig(arm="identity", split=split, tail=16, rows=ROWS)
    prompts = _prompts((90, 60))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    bounded = _engine(folder, "off", fill=fill)
    assert bounded.caches.layout.split == split and bounded.runner.planner.defer_windows
    full = _engine(folder, "off", window_bounded=False, fill=fill)
    bounded.scheduler.select = full.scheduler.select = SELECT
    got, peak = _run(bounded, prompts, params, check_pages=True)
    want, _ = _run(full, prompts, params)
    # the late window pages came with the late sweep: fewer than the table's blocks at the peak
    eager = _engine(folder, "off", fill=dataclasses.replace(fill, value_rescale=True))
    eager.scheduler.select = SELECT
    assert not eager.scheduler.caches.pages.lazy and bounded.scheduler.caches.pages.lazy
    _, eager_peak = _run(eager, prompts, params, check_pages=True)
    assert peak < eager_peak
    for a, b in zip(got, want):
        assert a.fill.boundary > 0 and len(a.fill.exact_rows) > 2 and a.fill.exact_rows == b.fill.exact_rows
        assert a.output_ids == b.output_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs.output, b.logprobs.output)) < 1e-5


def test_filled_rows_no_late_row_reaches_are_never_written(gemma):
    """Offline, slabs poisoned with NaN: at the windowed late layer a filled row's slot is written
    iff some exact prefix row or tail row lies less than `window` positions after it, and the
    logits equal a run that writes every filled row (a splice hook turns the deferral off)."""
    folder, ref = gemma
    from ridgefill_runtime.loader.hf import load_hf_folder
    from ridgefill_runtime.models.registry import family
    from ridgefill_runtime.offline import PromptLogits
    import ridgefill_runtime.sequence_driver as sequence_driver

    ckpt = load_hf_folder(folder)
    model = family(ckpt.config.architecture).build_model(ckpt.config, ckpt.tensors, torch.float32, "cpu")
    split = ref.config.num_hidden_layers // 2
    fill = FillConfig(
        arm="identity",
        split=split,
        tail=16,
        rows=ROWS.replace(selectors=("special", "attention"), attention_share=0.06),
    )
    ids = _prompts((120,), seed=11)[0]
    real_build = sequence_driver.build_caches

    def poisoned(*a, **kw):
        caches = real_build(*a, **kw)
        for slabs in (caches.kv.k, caches.kv.v):
            for t in slabs.values():
                t.fill_(float("nan"))
        return caches

    sequence_driver.build_caches = poisoned
    try:
        _, deferred, runner, seq = PromptLogits(model, fill, chunk=32, selector=SELECT)(ids)
        _, every, _, _ = PromptLogits(model, fill, chunk=32, selector=SELECT)(ids, after_fill=lambda r, s: None)
    finally:
        sequence_driver.build_caches = real_build
    assert torch.isfinite(deferred).all()
    assert (deferred - every).abs().max() < 1e-4 * every.abs().max()
    late_rows = sorted(set(seq.fill.exact_rows) | set(range(seq.fill.boundary, len(ids))))
    slots = runner._seq_slots(seq, 0, seq.fill.boundary)
    written = ~torch.isnan(runner.kv.k[2][runner.kv.physical(2, slots)]).flatten(1).any(1)  # layer 2: late, windowed
    assert model.config.family_config.window_of(2) == WINDOW and split <= 2
    for p in range(seq.fill.boundary):
        if p in seq.fill.exact_rows:
            continue
        reached = any(0 < q - p < WINDOW for q in late_rows)
        assert bool(written[p]) == reached, p
    assert 0 < int(written.sum()) < seq.fill.boundary - len(seq.fill.exact_rows)


def test_speculative_rollback_gives_back_the_rejected_blocks_pages(gemma):
    folder, _ = gemma
    base = _prompts((12,), seed=9)[0]
    prompts = [base * 6]  # repeats: the n-gram drafter proposes, some drafts are rejected
    spec = SpeculativeConfig(method="ngram", num_tokens=4)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    bounded = _engine(folder, "off", speculative=spec)
    got, _ = _run(bounded, prompts, params, check_pages=True)
    want, _ = _run(_engine(folder, "off", window_bounded=False, speculative=spec), prompts, params)
    assert bounded.scheduler.spec.steps > 0
    assert got[0].output_ids == want[0].output_ids
