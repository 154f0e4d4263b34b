"""Causal self-attention over the paged KV cache for a flat batch of variable-length rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def causal_offset_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, k_len] bool, True where allowed; queries are the last q_len of k_len positions."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return k_pos <= q_pos


def attend_at(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Chosen query rows q [R, H, D] at context positions q_pos [R] over k/v [Lk, Hkv, D]."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]
    mask = None
    if not (q.shape[0] == 1 and int(q_pos[0]) == k.shape[0] - 1):  # a last row sees everything
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [R, Lk]
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
        outs.append(attend(q[lo:hi], k, v, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def paged_attention_rows(q: torch.Tensor, rows: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         kv, layer: int, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Like paged_attention, but only the sorted batch rows `rows` [R] attend; all rows' K/V
    are written. q [R, H, D] holds those rows' queries -> [R, H*D]."""
    kv.write(layer, batch.write_slots, k_new, v_new)
    starts = torch.tensor(batch.query_starts, device=rows.device)
    owner = torch.searchsorted(starts, rows, right=True) - 1  # [R] sequence of each row
    ctx = torch.tensor(batch.context_lens, device=rows.device)
    pos = ctx[owner] - (starts[owner + 1] - rows)  # [R] position of each row in its context
    outs = []
    for i in owner.unique_consecutive().tolist():
        pick = (owner == i).nonzero().flatten()
        k, v = _context(k_new, v_new, kv, layer, batch, i)
        outs.append(attend_at(q[pick], pos[pick], k, v, scale))
    if not outs:  # a step where no sequence wants logits (a mid-prompt chunk)
        return q.new_empty(0, q.shape[1] * q.shape[2])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
