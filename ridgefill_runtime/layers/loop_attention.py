"""Attention of a looped model's core layers over the loop-plane cache (seed 001 §2, §4).

Loop r of the token at position t reads each cached position j (j < t0, cached before this step)
from the plane the sequence's policy names (Eq. (9)):
    full       plane r everywhere (window None);
    RIPE(W)    plane r if t - j <= W, else the deepest plane R; W = 0 is the deepest-plane cache.
Positions in the step itself (a prefill chunk, a verification block) are read at loop r, from the
K/V this pass computed: their plane R does not exist yet while loop r < R runs. With W >= the
block length that is exactly Eq. (9) (Proposition 1); for a prefill chunk longer than W it is
what Huginn's own batched prefill does (every prompt token reads its peers' plane r).

Where planes live (the storage, cache/spec.LoopPlanesCache): paged K/V slabs keyed (layer, plane)
for the planes kept for every position, and for "ripe" a per-sequence ring of the W most recent
positions' planes 1..R-1 (StatePool.rings, position j at slot j % W). A verification's ring rows
go to StatePool.pending first: the cache manager's rollback commits the accepted ones
(Algorithm 1 line 7), so rejected rows never evict a window position the next step still reads.

A draft pass (Algorithm 1 line 3) runs d loops. Under RIPE or the deepest plane it reads plane R
of every cached position and each loop overwrites the row's deepest-plane slot, so later drafts
read earlier drafts at loop d; under the full policy it reads and writes plane r (the draft of a
full cache, seed 001 §3.3). The verification then rewrites every plane of those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache.spec import LoopPlanesCache
from ..ops import op_available


@dataclass(frozen=True)
class LoopRead:
    """How one sequence's rows run the core loops in a step."""

    loops: int  # R: loops its rows run (<= the stored planes)
    window: int | None = None  # None: full policy; W >= 0: RIPE(W) (W = 0: deepest plane)
    draft: bool = False  # a draft pass: window 0 reads plane R, None plane r; never the ring
    seed: int = 0  # its initial states' seed (with each row's position)


def default_reads(storage: LoopPlanesCache, num_seqs: int, loops: int | None = None) -> tuple[LoopRead, ...]:
    """What a step that names no policy runs: the storage's own policy at its loop count."""
    window = None if storage.kind == "full" else storage.window if storage.kind == "ripe" else 0
    return (LoopRead(loops or storage.loops, window),) * num_seqs


class LoopAttention:
    """One forward's loop attention: binds the batch, its reads and the caches; call per (layer, loop)."""

    def __init__(
        self,
        storage: LoopPlanesCache,
        caches,
        batch,
        reads: tuple[LoopRead, ...],
        scale: float,
        use_op: bool | None = None,
    ):
        """use_op: run the compiled ripe_attention op (None: on CUDA where it is built; the
        tests force it on CPU, where it is its reference, to check the layout it is given)."""
        self.storage, self.kv, self.states = storage, caches.kv, caches.states
        self.batch, self.reads, self.scale = batch, reads, scale
        self.use_op = use_op
        self.row_starts = batch.query_starts
        self._deep: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, seq) -> far K/V, reused by every loop

    def __call__(
        self, layer: int, r: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: list[int], starts: list[int]
    ) -> torch.Tensor:
        """Rows of `seqs` (laid out by `starts`): q [n, H, D], k/v [n, Hkv, D] at loop r -> [n, H*D]."""
        self._write_paged(layer, r, k, v, seqs, starts)
        if self.use_op if self.use_op is not None else on_ripe_kernel(q):
            out = self._attend_op(layer, r, q, k, v, seqs, starts)
        else:
            outs = [
                self._attend_one(layer, r, q[lo:hi], k[lo:hi], v[lo:hi], i)
                for i, lo, hi in zip(seqs, starts, starts[1:])
            ]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
        self._write_ring(layer, r, k, v, seqs, starts)
        return out

    # -- where a plane lives ----------------------------------------------------------------

    def deep_key(self, layer: int, i: int) -> tuple[int, int]:
        """The paged slab holding sequence i's deepest plane (its R-th loop)."""
        if self.storage.kind == "full":
            return (layer, self.reads[i].loops)
        return (layer, self.storage.loops)

    def _paged_write_key(self, layer: int, r: int, i: int) -> tuple[int, int] | None:
        read = self.reads[i]
        if read.draft and read.window is None:  # a full-policy draft keeps its own planes
            return (layer, r)
        if read.draft or r == read.loops:
            return self.deep_key(layer, i)
        return (layer, r) if self.storage.kind == "full" else None

    def _slots(self, i: int) -> torch.Tensor:
        lo, hi = self.row_starts[i], self.row_starts[i + 1]
        return self.batch.write_slots[lo:hi]

    # -- writing -------------------------------------------------------------------------------

    def _write_paged(self, layer, r, k, v, seqs, starts) -> None:
        for i, lo, hi in zip(seqs, starts, starts[1:]):
            key = self._paged_write_key(layer, r, i)
            if key is not None:
                self.kv.write(key, self._slots(i), k[lo:hi], v[lo:hi])

    def _write_ring(self, layer, r, k, v, seqs, starts) -> None:
        """Planes r < R of the ripe storage: the ring (or, verifying, the pending rows)."""
        if self.storage.ring_shape is None:
            return
        ring, width = self.states.rings[layer], self.storage.window
        for i, lo, hi in zip(seqs, starts, starts[1:]):
            read = self.reads[i]
            if read.draft or r == read.loops:
                continue
            slot, n = self.batch.state_slots[i], hi - lo
            t0 = self.batch.context_lens[i] - n
            if self.batch.verifies is not None and self.batch.verifies[i]:
                pending = self.states.pending[layer]
                pending["k"][slot, :n, r - 1] = k[lo:hi]
                pending["v"][slot, :n, r - 1] = v[lo:hi]
                self.states.pending_from[slot] = t0
                continue
            keep = min(n, width)  # NOTE: only the window's positions stay
            at = torch.arange(t0 + n - keep, t0 + n, device=k.device) % width
            ring["k"][slot, at, r - 1] = k[hi - keep : hi]
            ring["v"][slot, at, r - 1] = v[hi - keep : hi]

    # -- reading -------------------------------------------------------------------------------

    def window_of(self, r: int, i: int) -> int | None:
        """Sequence i's W at loop r: None reads plane r everywhere; at the deepest loop every
        cached position is read at the deepest plane, W = 0. A draft reads plane r (full policy)
        or plane R (any other) throughout."""
        read = self.reads[i]
        if read.draft:
            return read.window
        return 0 if r == read.loops else read.window

    def _attend_one(self, layer, r, q, k_new, v_new, i) -> torch.Tensor:
        n = q.shape[0]
        t0 = self.batch.context_lens[i] - n
        window = self.window_of(r, i)
        if t0 == 0:
            return _sdpa(q, k_new, v_new, None, self.scale, causal=True)
        if window is None:  # full policy: plane r of every cached position
            far_k, far_v = self.kv.read((layer, r), self.batch.read_slots[i][:t0])
            near = 0
            k = torch.cat([far_k, k_new])
            v = torch.cat([far_v, v_new])
        else:
            near = min(window, t0)
            far_k, far_v = self._far(layer, i, t0)
            near_k, near_v = self._near(layer, r, i, t0, near)
            k = torch.cat([far_k, near_k, k_new])
            v = torch.cat([far_v, near_v, v_new])
        if n == 1:  # NOTE: one row: the far plane only beyond the window, no mask
            if window is not None and near:
                keep = torch.cat(
                    [torch.arange(t0 - near, device=q.device), torch.arange(t0, t0 + near + 1, device=q.device)]
                )
                k, v = k[keep], v[keep]
            return _sdpa(q, k, v, None, self.scale)
        return _sdpa(q, k, v, _mask(n, t0, near, window, q.device), self.scale)

    def _attend_op(self, layer, r, q, k, v, seqs, starts) -> torch.Tensor:
        """The compiled op, one call per read window among `seqs` (in a step almost always one):
        each sequence's rows padded to the longest block, its far plane by position and its near
        ring (slot j % C) padded to the longest; padding is never read or is dropped."""
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [n, H*D]
        by_window: dict = {}
        for a, i in enumerate(seqs):
            by_window.setdefault(self.window_of(r, i), []).append(a)
        for window, members in by_window.items():
            self._attend_op_group(
                layer,
                r,
                q,
                k,
                v,
                [seqs[a] for a in members],
                [(starts[a], starts[a + 1]) for a in members],
                window,
                out,
            )
        return out

    def _attend_op_group(self, layer, r, q, k, v, seqs, spans, window, out) -> None:
        from ..ops.ripe_attention import ripe_attention

        lens = [hi - lo for lo, hi in spans]
        t0s = [self.batch.context_lens[i] - n for i, n in zip(seqs, lens)]
        far, near = [], []
        for i, t0 in zip(seqs, t0s):
            if window is None:  # full policy: plane r everywhere, read as the "deep" plane
                far.append(self.kv.read((layer, r), self.batch.read_slots[i][:t0]) if t0 else _no_rows(k))
                near.append(_no_rows(k))
            else:
                far.append(self._far(layer, i, t0) if t0 else _no_rows(k))
                # NOTE: padding a ring keeps its slots: a RIPE store's rings all have W slots, and a
                # full store's "ring" is plane r by position (slot j = j, C >= t0)
                near.append(self._ring_view(layer, r, i, t0, window, far[-1][0]) if window and t0 else _no_rows(k))
        tq, t_max = max(lens), max(1, max(t0s))
        c_max = max(1, window or 0, max(n[0].shape[0] for n in near))  # NOTE: the op wants C >= W
        qb, kb, vb = (_pad_stack([x[lo:hi] for lo, hi in spans], tq) for x in (q, k, v))  # [B, Tq, *, D]
        res = ripe_attention(
            qb,
            kb,
            vb,
            _pad_stack([f[0] for f in far], t_max),
            _pad_stack([f[1] for f in far], t_max),
            _pad_stack([n[0] for n in near], c_max),
            _pad_stack([n[1] for n in near], c_max),
            torch.tensor(t0s, dtype=torch.int32, device=q.device),
            window or 0,
            self.scale,
        )
        for b, (lo, hi) in enumerate(spans):
            out[lo:hi] = res[b, : hi - lo].reshape(hi - lo, -1)

    def _ring_view(self, layer, r, i, t0, window, far_k):
        """Plane r of the window's positions as a ring [C >= W, Hkv, D], slot j % C."""
        if window == 0:
            return far_k[:1], far_k[:1]
        if self.storage.kind == "ripe":
            ring, slot = self.states.rings[layer], self.batch.state_slots[i]
            return ring["k"][slot, :, r - 1], ring["v"][slot, :, r - 1]
        # NOTE: a full store read under RIPE(W): plane r of every cached position, slot j == j,
        # padded to W slots (a padding slot is a position >= t0, never read from the ring)
        k, v = self.kv.read((layer, r), self.batch.read_slots[i][:t0])
        pad = max(0, window - t0)
        return (torch.cat([k, k.new_zeros(pad, *k.shape[1:])]), torch.cat([v, v.new_zeros(pad, *v.shape[1:])]))

    def _far(self, layer: int, i: int, t0: int):
        """The deepest plane of positions 0..t0-1 [t0, Hkv, D]: the same for every loop of the step."""
        key = (layer, i)
        if key not in self._deep:
            self._deep[key] = self.kv.read(self.deep_key(layer, i), self.batch.read_slots[i][:t0])
        return self._deep[key]

    def _near(self, layer: int, r: int, i: int, t0: int, near: int):
        """Plane r of the `near` positions before t0 [near, Hkv, D]: paged (full storage) or the ring."""
        if near == 0:
            return _no_rows(self.kv.k[self.deep_key(layer, i)][:0].to(self.kv.read_dtype))
        if self.storage.kind == "full":
            return self.kv.read((layer, r), self.batch.read_slots[i][t0 - near : t0])
        ring, slot = self.states.rings[layer], self.batch.state_slots[i]
        at = torch.arange(t0 - near, t0, device=ring["k"].device) % self.storage.window
        return ring["k"][slot, at, r - 1], ring["v"][slot, at, r - 1]


def _no_rows(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty K/V pair [0, Hkv, D] (a sequence with nothing cached, or no ring)."""
    empty = like.new_zeros(0, *like.shape[1:])
    return empty, empty


def _pad_stack(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """[len(rows), length, *] with each row's entries first and zeros after."""
    out = rows[0].new_zeros(len(rows), length, *rows[0].shape[1:])
    for b, x in enumerate(rows):
        out[b, : x.shape[0]] = x
    return out


def _mask(n: int, t0: int, near: int, window: int | None, device) -> torch.Tensor:
    """[n, t0 + near + n] bool, True where query a (position t0 + a) reads the key: far positions
    j < t0 beyond the window, near positions t0-near.. within it, block rows up to itself."""
    t = torch.arange(t0, t0 + n, device=device)[:, None]  # [n, 1]
    far = torch.arange(t0, device=device)[None, :]
    block = torch.arange(t0, t0 + n, device=device)[None, :] <= t
    if window is None:
        return torch.cat([far.expand(n, -1) < t0, block], dim=1)
    near_pos = torch.arange(t0 - near, t0, device=device)[None, :]
    return torch.cat([t - far > window, t - near_pos <= window, block], dim=1)


def _sdpa(q, k, v, mask, scale: float, causal: bool = False) -> torch.Tensor:
    """q [n, H, D] over k/v [L, Hkv, D] -> [n, H*D]."""
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, is_causal=causal, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def on_ripe_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and op_available("ripe_attention")
