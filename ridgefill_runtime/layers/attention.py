"""Causal self-attention over the paged KV cache for a flat batch of variable-length rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import op_available


@dataclass
class AttentionBatch:
    """Where each sequence's rows sit in the flat batch and where its K/V live.

    Sequence i owns rows query_starts[i]:query_starts[i+1]; they are its last positions,
    so it sees positions 0..context_lens[i]-1 after this step's rows are written.
    """

    query_starts: list[int]  # [B+1]
    context_lens: list[int]  # [B]
    write_slots: torch.Tensor  # [N] int64, cache slot of each row
    read_slots: list[torch.Tensor | None]  # per sequence [ctx] int64; None: all context is in this step
    # Scattered rows (RidgeFill's exact prefix rows, the probe): per sequence the rows' own
    # positions [n_i] and the positions of the keys in read_slots [ctx_i]; a row sees the keys
    # at positions <= its own. None: the rows are the last positions and keys are 0..ctx-1.
    query_pos: list[torch.Tensor | None] | None = None
    key_pos: list[torch.Tensor | None] | None = None
    # Per sequence, its row in the state pool (layers that keep a recurrent state read it);
    # None where the step's rows keep no per-sequence state.
    state_slots: list[int | None] | None = None
    # Per sequence, whether its recurrent states start from zero at its first row this step; None:
    # where its rows start at position 0 (the probe starts a scratch state mid-sequence).
    state_fresh: list[bool] | None = None
    # Per sequence, whether its rows verify a speculative draft: a recurrent layer then keeps
    # its state after every row (StatePool.history) so the rejected rows can be rolled back.
    verifies: list[bool] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def scattered(self, i: int) -> bool:
        return self.query_pos is not None and self.query_pos[i] is not None

    def row_positions(self, i: int, device) -> torch.Tensor:
        """Positions [n_i] of sequence i's rows."""
        if self.scattered(i):
            return self.query_pos[i]
        lo, hi = self.query_starts[i], self.query_starts[i + 1]
        return torch.arange(self.context_lens[i] - (hi - lo), self.context_lens[i], device=device)

    def key_positions(self, i: int, device) -> torch.Tensor:
        """Positions [ctx_i] of the keys sequence i reads."""
        if self.key_pos is not None and self.key_pos[i] is not None:
            return self.key_pos[i]
        return torch.arange(self.context_lens[i], device=device)


def causal_offset_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, k_len] bool, True where allowed; queries are the last q_len of k_len positions."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return k_pos <= q_pos


def attend_at(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float, k_pos: torch.Tensor | None = None) -> torch.Tensor:
    """Chosen query rows q [R, H, D] at positions q_pos [R] over k/v [Lk, Hkv, D] whose
    positions are k_pos [Lk] (None: 0..Lk-1); a row sees keys at positions <= its own."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]
    mask = None
    last = int(q_pos[0]) == (k.shape[0] - 1 if k_pos is None else int(k_pos[-1]))
    if not (q.shape[0] == 1 and last):  # a last row sees everything
        if k_pos is None:
            k_pos = torch.arange(k.shape[0], device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [R, Lk]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)  # [R, H*D]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H*D], queries = last Lq positions."""
    q_len, k_len = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    elif q_len == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    else:
        mask = causal_offset_mask(q_len, k_len, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q_len, -1)  # [Lq, H*D]


def _context(k_new, v_new, kv, layer: int, batch: AttentionBatch, i: int):
    """Sequence i's K/V over its whole context [ctx, Hkv, D]."""
    slots = batch.read_slots[i]
    if slots is None:  # NOTE: fresh prefill: its K/V are all in hand, skip the gather.
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        return k_new[lo:hi], v_new[lo:hi]
    return kv.read(layer, slots)


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    kv, layer: int, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend per sequence.

    q [N, H, D], k_new/v_new [N, Hkv, D] -> [N, H*D].
    """
    kv.write(layer, batch.write_slots, k_new, v_new)
    outs = []
    for i in range(batch.num_seqs):
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        k, v = _context(k_new, v_new, kv, layer, batch, i)
        if _on_scattered_kernel(q, batch, i):
            outs.append(_scattered_kernel(q[lo:hi], batch, i, kv, layer, scale))
        elif batch.scattered(i) or (batch.key_pos is not None and batch.key_pos[i] is not None):
            outs.append(attend_at(q[lo:hi], batch.row_positions(i, q.device), k, v, scale,
                                  batch.key_positions(i, q.device)))
        else:
            outs.append(attend(q[lo:hi], k, v, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _on_scattered_kernel(q, batch: AttentionBatch, i: int) -> bool:
    """Scattered rows over keys 0..ctx-1 run on the compiled kernel where it exists (CUDA/HIP)."""
    return (q.is_cuda and batch.scattered(i) and batch.read_slots[i] is not None
            and (batch.key_pos is None or batch.key_pos[i] is None) and op_available("scattered_rows_attention"))


def _scattered_kernel(q, batch: AttentionBatch, i: int, kv, layer: int, scale: float) -> torch.Tensor:
    """NOTE: a block table of block size 1 is the sequence's slot list itself, so the kernel
    reads position p at read_slots[p] without knowing the cache's real block size."""
    from ..ops.scattered_rows_attention import scattered_rows_attention

    slots = batch.read_slots[i]
    table = slots.to(torch.int32)[None, :]  # [1, ctx]
    ctx = torch.tensor([slots.shape[0]], dtype=torch.int32, device=q.device)
    q_seq = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
    out, _ = scattered_rows_attention(q, q_seq, batch.query_pos[i], kv.k[layer], kv.v[layer], table, ctx, 1, scale)
    return out.reshape(q.shape[0], -1)  # [n, H*D]


def paged_attention_rows(q: torch.Tensor, rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         kv, layer: int, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Like paged_attention, but only the sorted batch rows `rows` [R] attend; all rows' K/V
    are written. q [R, H, D] holds those rows' queries -> [R, H*D]."""
    kv.write(layer, batch.write_slots, k_new, v_new)
    starts = torch.tensor(batch.query_starts, device=rows.device)
    owner = torch.searchsorted(starts, rows, right=True) - 1  # [R] sequence of each row
    outs = []
    for i in owner.unique_consecutive().tolist():
        pick = (owner == i).nonzero().flatten()
        pos = batch.row_positions(i, rows.device)[rows[pick] - batch.query_starts[i]]  # [Ri]
        k, v = _context(k_new, v_new, kv, layer, batch, i)
        k_pos = batch.key_pos[i] if batch.key_pos is not None else None
        outs.append(attend_at(q[pick], pos, k, v, scale, k_pos))
    if not outs:  # a step where no sequence wants logits (a mid-prompt chunk)
        return q.new_empty(0, q.shape[1] * q.shape[2])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def key_mass(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
             scale: float, rows_per_block: int = 64) -> torch.Tensor:
    """Attention each key receives: q [R, H, D] at q_pos [R] over k [Lk, Hkv, D] at k_pos [Lk]
    -> float32 [Lk], the softmax probabilities summed over rows and heads (causal by position).

    What the attention and probe selectors rank prefix rows by (seed 000, §2.4); the same
    quantity as scattered_rows_attention's key_mass. Rows go in blocks to bound the [r, H, Lk]
    score tensor."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [Lk, H, D]
    mass = torch.zeros(k.shape[0], dtype=torch.float32, device=q.device)
    for lo in range(0, q.shape[0], rows_per_block):
        qb, pb = q[lo:lo + rows_per_block].float(), q_pos[lo:lo + rows_per_block]
        scores = torch.einsum("rhd,lhd->rhl", qb, kf) * scale  # [r, H, Lk]
        visible = k_pos[None, :] <= pb[:, None]  # [r, Lk]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        mass += torch.softmax(scores, dim=-1).sum(dim=(0, 1))
    return mass
