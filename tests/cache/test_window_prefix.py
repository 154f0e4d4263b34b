"""The prefix cache over window-bounded pages (cache/window_pages.py), ids only: pages let go stay
cache entries, a hit takes exactly the pages its next row reads, shared pages are counted once
per holder, and a hit never outlives the pages it needs.

References: the definition of what a row reads (a global group every earlier position, a window
group the `window` positions up to it), checked by brute force over every hit length, and the
pool's own page_of mirror (what on_map told it) for which page a block reads in each group.
"""

from __future__ import annotations

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.kv_layout import KVLayout
from ridgefill_runtime.cache.manager import CacheManager
from ridgefill_runtime.cache.prefix_cache import EXACT
from ridgefill_runtime.cache.window_pages import WindowPages, page_key
from ridgefill_runtime.sequence import SamplingParams, Sequence

BS = 4
# group 0 global; group 1 global too (a second global group, as when the fill split cuts the
# layers); groups 2 and 3 windows of 8 and 13 positions
LAYOUT = KVLayout(BS, ((0, (0,)), (0, (1,)), (8, (2,)), (13, (3,))))
WINDOWS = {1: 0, 2: 8, 3: 13}


def _manager(num_pages: int = 400):
    blocks = BlockManager(num_pages, BS)
    mapped: dict[int, dict[int, int]] = {g: {} for g in WINDOWS}
    pages = WindowPages(LAYOUT, blocks, lambda g, bs, ps: mapped[g].update(zip(bs, ps)))
    return CacheManager(blocks, 8, prefix_caching=True, window_pages=pages), mapped


def _seq(tokens) -> Sequence:
    seq = Sequence(prompt_ids=list(tokens), params=SamplingParams())
    seq.prefix.identity = EXACT
    return seq


def _run_to_end(mgr: CacheManager, seq: Sequence, mapped=None) -> dict:
    """Admit seq (from whatever the cache holds), compute its prompt and one token, publish and
    let go of what it no longer reads, as the scheduler does after each step. Returns, per
    group, the page each of its blocks was written into (from the pool's mirror `mapped`)."""
    mgr.allocate(seq, seq.num_tokens, mgr.match(seq))
    written = {g: {i: m.get(b) for i, b in enumerate(seq.block_table)} for g, m in (mapped or {}).items()}
    seq.num_computed = seq.num_tokens
    seq.output_ids.append(0)
    mgr.publish(seq)
    mgr.trim(seq)
    return written


def _reads(num_blocks: int) -> dict[int, range]:
    """The definition: the blocks a row at position num_blocks * BS reads in each group."""
    at = num_blocks * BS
    return {g: range(0 if w == 0 else max(0, at - w + 1) // BS, num_blocks) for g, w in WINDOWS.items()}


def test_a_hit_takes_the_pages_its_next_row_reads_and_they_are_the_computed_ones():
    mgr, mapped = _manager()
    doc = list(range(100, 140))  # 10 blocks
    first = _seq(doc + [1, 2, 3])
    before = _run_to_end(mgr, first, mapped)
    mgr.free(first)
    assert mgr.blocks.num_free == mgr.blocks.num_blocks  # every page back: cached ones count as free
    second = _seq(doc + [7, 7])
    hit = mgr.match(second)
    assert hit.num_tokens == 40
    want = {(g, i) for g, r in _reads(10).items() for i in r}
    assert {(g, i) for g, i, _ in hit.pages} == want
    mgr.allocate(second, second.num_tokens, hit)
    for g, i in want:  # the pool reads the very page the first sequence wrote
        assert mapped[g][second.block_table[i]] == before[g][i]
    # held: group 0's 10 blocks + 1 new, and per group its pages read plus the new block's
    assert mgr.stats().kv_blocks_used == 11 + len(want) + len(WINDOWS)


def test_pages_let_go_early_are_found_until_evicted_and_the_hit_shrinks_to_what_is_left():
    mgr, mapped = _manager()
    doc = list(range(200, 248))  # 12 blocks
    first = _seq(doc + [5])
    _run_to_end(mgr, first)
    keys = [mgr.blocks.key_of(b) for b in first.block_table[:12]]
    mgr.free(first)
    # evict block 9's page in group 3 (window 13): hits that read it must stop before it
    evicted = mgr.blocks.lookup(page_key(keys[9], 3))
    mgr.blocks._unpublish(evicted)
    mgr.blocks._cached.pop(evicted)
    mgr.blocks._clean.append(evicted)
    for k in range(12, 0, -1):
        if 9 not in _reads(k)[3]:
            break
    again = _seq(doc + [6])
    hit = mgr.match(again)
    assert hit.num_tokens == k * BS and all(not (g == 3 and i == 9) for g, i, _ in hit.pages)
    assert {(g, i) for g, i, _ in hit.pages} == {(g, i) for g, r in _reads(k).items() for i in r}
    mgr.allocate(again, again.num_tokens, hit)
    assert mgr.stats().prefix_window_cut_tokens == (12 - k) * BS  # counted for /metrics


def test_a_shared_page_stays_mapped_while_any_table_holds_it():
    mgr, mapped = _manager()
    doc = list(range(300, 340))
    first = _seq(doc + [1])
    mgr.allocate(first, first.num_tokens)
    first.num_computed = 40  # the prompt but its last token: blocks 0..9 are final
    mgr.publish(first)
    second = _seq(doc + [2])
    mgr.allocate(second, second.num_tokens, mgr.match(second))
    shared = {g: mapped[g][first.block_table[9]] for g in WINDOWS}
    # the first runs on far past its prompt: it lets go of block 9's window pages
    first.output_ids.extend([0] * 30)
    mgr.grow(first, first.num_tokens)
    first.num_computed = first.num_tokens - 1
    mgr.trim(first)
    for g in (2, 3):
        assert mapped[g][first.block_table[9]] == shared[g] >= 0  # the second still reads them
    mgr.free(second)
    for g in (2, 3):
        assert mapped[g][first.block_table[9]] == -1  # now nobody holds them: cached, unmapped
        assert mgr.blocks.is_free(shared[g]) and mgr.blocks.lookup(page_key(mgr.blocks.key_of(first.block_table[9]), g))
    mgr.free(first)
    assert mgr.blocks.num_free == mgr.blocks.num_blocks


def test_under_pressure_admission_counts_cached_pages_as_the_room_they_take():
    mgr, _ = _manager(num_pages=64)
    doc = list(range(400, 424))  # 6 blocks
    first = _seq(doc + [1])
    _run_to_end(mgr, first)
    mgr.free(first)
    second = _seq(doc + [2, 3])
    hit = mgr.match(second)
    cached = sum(mgr.blocks.is_free(b) for b in hit.blocks) + sum(mgr.blocks.is_free(p) for *_, p in hit.pages)
    new_blocks = -(-second.num_tokens // BS) - len(hit.blocks)
    assert mgr.can_allocate(second, second.num_tokens, reserved_blocks=64 - cached - 4 * new_blocks, hit=hit)
    assert not mgr.can_allocate(second, second.num_tokens, reserved_blocks=64 - cached - 4 * new_blocks + 1, hit=hit)
    mgr.allocate(second, second.num_tokens, hit)
    assert mgr.blocks.num_free == 64 - cached - 4 * new_blocks
