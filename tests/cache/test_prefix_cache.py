"""Prefix-cache bookkeeping without a model: reference counts, publishing, LRU eviction, and which
blocks a prompt may start from (chained keys, identities, the last-token rule)."""

from __future__ import annotations

import pytest

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.manager import CacheManager
from ridgefill_runtime.cache.prefix_cache import EXACT, PrefixCache, block_key, fill_identity, history_key
from ridgefill_runtime.sequence import SamplingParams, Sequence
from ridgefill_runtime.stages import Stage

BS = 4


def seq_of(tokens, identity=EXACT, computed=None) -> Sequence:
    seq = Sequence(prompt_ids=list(tokens), params=SamplingParams())
    seq.prefix.identity = identity
    seq.num_computed = len(tokens) if computed is None else computed
    return seq


def computed(manager: CacheManager, tokens, identity=EXACT, answered: bool = True) -> Sequence:
    """A sequence that holds blocks for its prompt and has computed all of it (and, when
    `answered`, sampled one token, so its last prompt position is final too)."""
    seq = seq_of(tokens, identity, computed=0)
    hit = manager.match(seq)
    manager.allocate(seq, len(tokens), hit)
    seq.num_computed = len(tokens)
    if answered:
        seq.output_ids.append(0)
    manager.publish(seq)
    return seq


def test_refcounts_and_release_order():
    bm = BlockManager(6, BS)
    a, b = [], []
    bm.grow(a, 3 * BS)
    for i, blk in enumerate(a):
        assert bm.publish(blk, bytes([i]), tuple(range(BS)))
    bm.share(b, a[0])
    bm.share(b, a[1])
    assert bm.num_free == 3
    held = list(a)
    bm.free(a)
    # held[2] is held by nobody but stays findable; held[0] and held[1] are still b's
    assert bm.num_free == 4 and a == []
    assert bm.is_free(held[2]) and not bm.is_free(held[0]) and bm.lookup(bytes([2])) == held[2]
    bm.free(b)
    assert bm.num_free == 6 and bm.num_cached == 3
    with pytest.raises(RuntimeError, match="released more often"):
        bm.free([held[0]])


def test_lru_eviction_takes_clean_blocks_first_then_the_oldest_entry():
    bm = BlockManager(4, BS)
    old, new = [], []
    bm.grow(old, 2 * BS)
    bm.publish(old[0], b"old0", ())
    bm.publish(old[1], b"old1", ())
    bm.free(old)  # NOTE: released last block first: old1 is the older entry
    bm.grow(new, 1 * BS)
    bm.publish(new[0], b"new0", ())
    bm.free(new)
    assert bm.num_free == 4 and bm.num_cached == 3
    grab = []
    bm.grow(grab, 1 * BS)  # the one clean block
    assert bm.evictions == 0 and bm.num_cached == 3
    bm.grow(grab, 2 * BS)  # evicts old1: the oldest entry
    assert bm.evictions == 1 and bm.lookup(b"old1") is None and bm.lookup(b"old0") is not None
    bm.grow(grab, 3 * BS)
    assert bm.lookup(b"old0") is None and bm.lookup(b"new0") is not None


def test_publish_refuses_free_blocks_and_keeps_the_first_entry():
    bm = BlockManager(3, BS)
    t = []
    bm.grow(t, 2 * BS)
    assert bm.publish(t[0], b"k", ())
    assert not bm.publish(t[1], b"k", ())  # another block already is the entry
    assert bm.lookup(b"k") == t[0]
    with pytest.raises(RuntimeError, match="free"):
        bm.publish(2, b"z", ())
    with pytest.raises(RuntimeError, match="not published"):
        bm.share([], t[1])


def test_key_chains_over_every_earlier_block():
    a = block_key(block_key(b"", [1, 2, 3, 4], EXACT), [9, 9, 9, 9], EXACT)
    b = block_key(block_key(b"", [1, 2, 3, 5], EXACT), [9, 9, 9, 9], EXACT)
    c = block_key(block_key(b"", [1, 2, 3, 4], b"filled"), [9, 9, 9, 9], EXACT)
    assert len({a, b, c}) == 3
    # one block key, two sets of exact rows: the blocks after it chain from two histories
    assert history_key(a, (0, 1)) != history_key(a, (0,))


def test_a_block_made_over_other_exact_rows_is_not_found_after_the_entry():
    mgr = CacheManager(BlockManager(32, BS), 4, prefix_caching=True)
    ident = fill_identity("identity", 1, "", "as-is")
    doc = list(range(300, 312))

    def filled(exact_rows, tail):
        seq = seq_of(doc + tail, ident, computed=0)
        seq.fill.boundary, seq.fill.exact_rows = 12, exact_rows
        mgr.allocate(seq, len(seq.prompt_ids))
        seq.num_computed = len(seq.prompt_ids)
        seq.output_ids.append(0)
        mgr.publish(seq)
        return seq

    first = filled([1], [7, 7, 7, 7])
    second = filled([2], [8, 8, 8, 8])  # same document, other exact rows: its blocks stay private
    assert mgr.match(seq_of(doc + [7, 7, 7, 7, 0], ident)).blocks == tuple(first.block_table[:4])
    # its question block chained from its own history, which no entry starts: only the document is found
    assert mgr.match(seq_of(doc + [8, 8, 8, 8, 0], ident)).blocks == tuple(first.block_table[:3])
    assert second.block_table[3] not in mgr.match(seq_of(doc + [8, 8, 8, 8, 0], ident)).blocks


def test_match_stops_before_the_last_token_and_at_the_first_difference():
    mgr = CacheManager(BlockManager(16, BS), 4, prefix_caching=True)
    first = computed(mgr, list(range(12)), answered=False)  # 3 full blocks, all published: 11 positions are final
    assert len(first.prefix.block_keys) == 2  # the block holding the last token is not final yet
    first.output_ids.append(99)  # the next step computes position 11
    first.num_computed = 12
    mgr.publish(first)
    assert len(first.prefix.block_keys) == 3
    # a prompt equal to the first 12 tokens: at most the blocks before its last token
    assert mgr.match(seq_of(range(12))).num_tokens == 8
    assert mgr.match(seq_of(list(range(12)) + [5])).num_tokens == 12
    assert mgr.match(seq_of(list(range(6)) + [77] * 10)).num_tokens == 4
    assert mgr.match(seq_of([1] + list(range(1, 16)))).num_tokens == 0
    assert mgr.match(seq_of(list(range(16)), identity=None)).num_tokens == 0


def test_exact_and_filled_requests_take_only_their_own_kind_of_block():
    mgr = CacheManager(BlockManager(32, BS), 4, prefix_caching=True)
    doc = list(range(100, 116))
    filled_id = fill_identity("identity", 1, "", "as-is")
    filled = computed(mgr, doc, filled_id)
    assert mgr.match(seq_of(doc + [1])).num_tokens == 0  # exact: none of the filled blocks
    assert mgr.match(seq_of(doc + [1], filled_id)).num_tokens == 16
    mgr.free(filled)
    exact = computed(mgr, list(range(200, 216)))
    # NOTE: exact blocks would make a filled request's filled rows exact: its answer would not
    # be its fill's (issue 32)
    assert mgr.match(seq_of(list(range(200, 216)) + [3], filled_id)).num_tokens == 0
    hit = mgr.match(seq_of(list(range(200, 216)) + [3]))
    assert hit.num_tokens == 16 and exact.prefix.block_keys == list(hit.keys)


def test_never_serves_only_the_identical_prompt():
    mgr = CacheManager(BlockManager(32, BS), 4, prefix_caching=True)
    doc = list(range(50, 70))
    ident = fill_identity("identity", 1, "", "never", doc, "rows")
    computed(mgr, doc, ident)
    assert mgr.match(seq_of(doc, ident)).num_tokens == 16
    other = doc[:16] + [1, 2, 3, 4]
    assert mgr.match(seq_of(other, fill_identity("identity", 1, "", "never", other, "rows"))).num_tokens == 0
    assert mgr.match(seq_of(doc, fill_identity("identity", 1, "", "never", doc, "other rows"))).num_tokens == 0


def test_filled_blocks_keep_their_exact_rows():
    mgr = CacheManager(BlockManager(32, BS), 4, prefix_caching=True)
    doc = list(range(10, 22))
    seq = seq_of(doc, fill_identity("ridgefill", 2, "m", "as-is"), computed=0)
    seq.fill.boundary, seq.fill.exact_rows = 9, [0, 5]
    mgr.allocate(seq, len(doc))
    seq.num_computed = len(doc)
    seq.output_ids.append(0)
    seq.fill.stage = Stage.LATE  # the two-sweep prefill is not over: nothing is final
    mgr.publish(seq)
    assert seq.prefix.block_keys == []
    seq.fill.stage = Stage.FULL
    mgr.publish(seq)
    hit = mgr.match(seq_of(doc + [0], seq.prefix.identity))
    assert hit.exact_rows == (0, 5, 9, 10, 11) and hit.filled_rows == 7


def test_allocation_counts_unheld_entries_as_free_and_shares_held_ones():
    mgr = CacheManager(BlockManager(4, BS), 4, prefix_caching=True)
    a = computed(mgr, list(range(16)))
    b = seq_of(list(range(13)), computed=0)
    hit = mgr.match(b)
    assert hit.blocks == tuple(a.block_table[:3])
    # b needs 4 blocks for 13 positions, 3 of them shared (held by a): one new, none free
    assert not mgr.can_allocate(b, 13, hit=hit)
    mgr.free(a)  # its entries stay, now unheld: taking them costs free blocks
    assert mgr.can_allocate(b, 13, hit=hit)
    mgr.allocate(b, 13, hit)
    assert b.block_table[:3] == list(hit.blocks) and mgr.blocks.num_free == 0
    mgr.free(b)
    assert mgr.blocks.num_free == 4
    stats = mgr.stats()
    assert stats.prefix_hit_tokens == 12 and stats.prefix_queried_tokens == 16 + 13


def test_prefix_cache_counts_queries_and_hits():
    pc = PrefixCache(BlockManager(8, BS))
    s = seq_of(range(9))
    pc.count(s, pc.match(s))
    assert (pc.queried_tokens, pc.hit_tokens) == (9, 0)


def test_an_equal_prompt_waits_for_blocks_in_flight_until_they_are_published_or_let_go():
    mgr = CacheManager(BlockManager(32, BS), 4, prefix_caching=True)
    owner = seq_of(range(13), computed=0)
    mgr.allocate(owner, 13, mgr.match(owner))
    other = seq_of(range(13), computed=0)
    assert mgr.match(other).waits and mgr.match(other).num_tokens == 0
    owner.num_computed = 8
    mgr.publish(owner)  # two blocks final; the third is still in flight
    hit = mgr.match(other)
    assert hit.num_tokens == 8 and hit.waits
    mgr.free(owner)  # let go (preempted, aborted): nobody waits on it any more
    hit = mgr.match(other)
    assert hit.num_tokens == 8 and not hit.waits
    assert not mgr.match(seq_of([5] * 13)).waits  # another prompt never waits


def test_make_own_copies_shared_blocks_and_keeps_entries_while_room_is_left():
    bm = BlockManager(5, BS)
    a, b = [], []
    bm.grow(a, 2 * BS)
    bm.publish(a[0], b"a0", ())
    bm.publish(a[1], b"a1", ())
    bm.share(b, a[0])
    bm.share(b, a[1])
    bm.free(a)  # b alone holds both entries now
    other = []
    bm.share(other, b[0])  # ... and another table holds the first too
    held = list(b)
    pairs = bm.make_own(b, [0, 1])  # 3 free: both copied, the entries stay
    assert [old for old, _ in pairs] == held and b[0] != held[0] and b[1] != held[1]
    assert bm.lookup(b"a0") == held[0] and bm.lookup(b"a1") == held[1] and bm.is_free(held[1])
    c = []
    bm.share(c, held[1])
    bm.grow(c, 2 * BS)  # takes the last free block
    assert bm.num_free == 0
    assert (
        bm.make_own(c, [0]) == [] and c[0] == held[1] and bm.lookup(b"a1") is None
    )  # no room: it stops being an entry
