"""Prefix caching: which published blocks a new prompt may start from, and what a sequence
publishes. Ids and hashes only; the blocks and their reference counts are block_manager.py's.

A full block's key is a chained hash: the previous block's history (its key and which of its
rows ran exactly), the block's token ids and the block's *identity*, which says how its K/V
were made. Every exact block has the identity EXACT (a looped model's: loop_identity),
so any two prompts with a common exact prefix share it. A filled sequence's own blocks carry
its fill identity (`fill_identity`): arm, split, map file, and, under reuse_filled = "never",
the whole prompt and its exact-row settings, so they serve only that prompt again. A filled
sequence looks up its own identity only: exact blocks would make its filled rows exact.

Why the identity and the chain suffice: an exact block's K/V depend on its tokens and every
earlier token; a filled block's late K/V on those, on how the fill predicted them and on which
earlier rows were exact. The chain carries all of it: the key of block i names the identities
and exact rows of blocks 0..i-1 and the identity of block i. Its own exact rows are kept beside
it; under "as-is" a request takes whichever rows the block's maker ran exactly.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from .block_manager import BlockManager

EXACT = b"exact"
ROOT = b""  # the parent key of a sequence's first block


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks a prompt may start from: `blocks` hold its first len(blocks) * block
    size positions, with the history keys (history_key) the blocks after them chain from; `exact_rows` are the positions among them whose late K/V
    were made exactly (all of them for exact blocks)."""

    blocks: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()
    exact_rows: tuple[int, ...] = ()
    num_tokens: int = 0
    waits: bool = False  # the next block is being computed by a running sequence: wait for it
    # window layouts: (group, index in blocks, page) of the window pages the next row reads,
    # found by WindowPages.readable(); cut() drops them (a shorter hit reads other pages)
    pages: tuple[tuple[int, int, int], ...] = ()
    window_cut: int = 0  # tokens whose blocks were cached but not the window pages they read
    state_cut: int = 0  # tokens whose blocks were cached but no state snapshot after them
    state: bytes | None = None  # recurrent models: the key of the state snapshot after the last block

    @property
    def filled_rows(self) -> int:
        """Cached positions whose late K/V were filled."""
        return self.num_tokens - len(self.exact_rows)

    def cut(self, num_tokens: int) -> PrefixHit:
        """The hit's blocks that end at or before position `num_tokens`."""
        if num_tokens >= self.num_tokens:
            return self
        k = num_tokens // (self.num_tokens // len(self.blocks))
        end = self.num_tokens // len(self.blocks) * k
        return PrefixHit(self.blocks[:k], self.keys[:k], tuple(r for r in self.exact_rows if r < end), end)


NO_HIT = PrefixHit()


def block_key(parent: bytes, tokens: list[int], identity: bytes) -> bytes:
    """The key of a block holding `tokens` after the block keyed `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(identity)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def history_key(key: bytes, exact: tuple[int, ...]) -> bytes:
    """What the next block chains from: a block's key and which of its rows ran exactly. Two
    filled blocks of one key but other exact rows are two histories for the blocks after them."""
    return hashlib.blake2b(key + array("q", exact).tobytes(), digest_size=16).digest()


def fill_identity(
    arm: str, split: int, maps_digest: str, policy: str, prompt: list[int] | None = None, settings: str = ""
) -> bytes:
    """A filled request's block identity. `prompt` and `settings` (its exact-row choice, as
    text) enter only under "never", whose blocks serve the byte-identical request alone. The
    policy is one of config.REUSE_POLICIES (FillConfig and Engine.add_request check it)."""
    # NOTE: "reselect" and "as-is" make and take the same blocks; they differ in what a request
    # does with the cached rows, not in what the rows hold
    kind = "never" if policy == "never" else "shared"
    h = hashlib.blake2b(f"fill|{arm}|{split}|{maps_digest}|{kind}".encode(), digest_size=16)
    if policy == "never":
        h.update(array("q", prompt or []).tobytes())
        h.update(settings.encode())
    return h.digest()


def loop_identity(loops: int, window: int | None, seed: int) -> bytes | None:
    """A looped request's block identity: its planes depend on its loop count, its read policy
    (window None: full, W: RIPE(W)) and the seed of its rows' initial states. None for the
    deepest-plane read (W = 0): its prefill chunks are not bounded, and a prompt row reads its own
    chunk's rows at loop r but older rows at the deepest plane, so its planes depend on where
    chunks start. RIPE(W) prefills in chunks of at most W + 1 rows, where both agree (seed 001
    Proposition 1; tests/models/test_looped_prefix_caching.py checks it in float64); the full
    policy reads plane r everywhere."""
    if window == 0:
        return None
    return hashlib.blake2b(f"loop|{loops}|{window}|{seed}".encode(), digest_size=16).digest()


class PrefixCache:
    """Looks prompts up among the published blocks and publishes what sequences computed."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.queried_tokens = 0  # prompt tokens looked up (the last one is never a hit)
        self.hit_tokens = 0  # of those, found
        self.window_cut_tokens = 0  # of those not found, the ones a window layer's evicted pages cost
        self.state_cut_tokens = 0  # and the ones no state snapshot was kept for
        # exact blocks running sequences are computing: key -> the sequence's id, and its keys
        self._computing: dict[bytes, int] = {}
        self._claims: dict[int, list[bytes]] = {}

    def match(self, seq) -> PrefixHit:
        """The longest run of published blocks the prompt starts with. NOTE: it stops a block
        short of the prompt's last token, whose logits the sequence must compute itself; so no
        sequence ever writes into a block it shares."""
        if seq.prefix.identity is None or seq.params.prompt_logprobs:  # NOTE: scoring needs every row's logits
            return NO_HIT
        bs, prompt, identity = self.block_size, seq.prompt_ids, seq.prefix.identity
        blocks: list[int] = []
        keys: list[bytes] = []
        exact: list[int] = []
        parent, waits = ROOT, False
        for i in range((len(prompt) - 1) // bs):
            tokens = prompt[i * bs : (i + 1) * bs]
            # NOTE: a filled request takes filled blocks only: an exact block's late K/V are exact
            # on every row, so its answer would no longer be its fill's (issue 32)
            found = self.blocks.lookup(block_key(parent, tokens, identity))
            if found is None:
                # NOTE: another running sequence computes this block now (n > 1, a burst on one
                # system prompt): waiting a step or two costs less than computing it twice
                waits = self._computing.get(block_key(parent, tokens, identity), seq.seq_id) != seq.seq_id
                break
            offsets = self.blocks.exact_offsets(found)
            parent = history_key(self.blocks.key_of(found), offsets)
            keys.append(parent)
            blocks.append(found)
            exact.extend(i * bs + r for r in offsets)
        return PrefixHit(tuple(blocks), tuple(keys), tuple(exact), len(blocks) * bs, waits)

    def claim(self, seq, hit: PrefixHit) -> None:
        """seq was admitted from `hit`: the exact prompt blocks it will compute are in flight
        until it publishes them (or lets them go), so an equal prompt waits instead of
        computing them too."""
        if seq.fill.boundary or seq.prefix.identity is None:  # NOTE: exact blocks (a looped request's too)
            return
        bs, parent, claimed = self.block_size, hit.keys[-1] if hit.keys else ROOT, []
        for i in range(len(hit.blocks), (len(seq.prompt_ids) - 1) // bs):
            key = block_key(parent, seq.prompt_ids[i * bs : (i + 1) * bs], seq.prefix.identity)
            if self.blocks.lookup(key) is None and self._computing.setdefault(key, seq.seq_id) == seq.seq_id:
                claimed.append(key)
            parent = history_key(key, tuple(range(bs)))
        self._claims[seq.seq_id] = claimed

    def unclaim(self, seq) -> None:
        """seq holds no blocks any more (finished, preempted): nobody waits on it."""
        for key in self._claims.pop(seq.seq_id, ()):
            if self._computing.get(key) == seq.seq_id:
                del self._computing[key]

    def count(self, seq, hit: PrefixHit) -> None:
        """An admission that used `hit`: count it for the metrics."""
        self.queried_tokens += len(seq.prompt_ids)
        self.hit_tokens += hit.num_tokens
        self.window_cut_tokens += hit.window_cut
        self.state_cut_tokens += hit.state_cut

    def publish(self, seq) -> list[tuple[int, bytes]]:
        """Publish seq's full blocks whose K/V are final: below the last token (whose K/V the
        next step computes) and below what was computed, once the two-sweep prefill is over.
        Returns (index in seq's table, key) of the blocks that became entries (a window
        layout publishes their pages under the same keys, window_pages.py)."""
        if seq.prefix.identity is None or not seq.fill.stage.done:
            return []
        bs, published = self.block_size, []
        valid = min(seq.num_computed, seq.num_tokens - 1)
        keys = seq.prefix.block_keys
        parent = keys[-1] if keys else ROOT
        for i in range(len(keys), min(valid // bs, len(seq.block_table))):
            key = block_key(parent, seq.tokens(i * bs, (i + 1) * bs), seq.prefix.identity)
            offsets = self._exact_offsets(seq, i)
            # NOTE: when another block already is this key's entry, ours stays private, and its
            # history (exact rows included) goes on in the keys of the blocks after it
            if self.blocks.publish(seq.block_table[i], key, offsets):
                published.append((i, key))
            self._computing.pop(key, None)
            parent = history_key(key, offsets)
            keys.append(parent)
        return published

    def _exact_offsets(self, seq, i: int) -> tuple[int, ...]:
        """Offsets in block i of rows whose late K/V ran exactly."""
        lo, hi = i * self.block_size, (i + 1) * self.block_size
        if lo >= seq.fill.boundary:
            return tuple(range(self.block_size))
        exact = {r for r in seq.fill.exact_rows if lo <= r < hi} | set(range(max(lo, seq.fill.boundary), hi))
        return tuple(sorted(r - lo for r in exact))
