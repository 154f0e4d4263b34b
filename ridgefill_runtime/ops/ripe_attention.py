"""ripe_attention: attention of one loop r of a looped (recurrent-depth) model under the RIPE cache.

RIPE (seed 001 §4, Eq. 9): loop r of the token at position t reads key position j from
    plane r      if t − j <= W          (the recent window, own loop's plane)
    plane R      otherwise              (the deepest loop's plane, stored for every position)
A block of Tq query tokens (a decode step, Tq = 1, or a γ+1 verification block) at positions
t0 .. t0+Tq−1 is processed in one pass. Block tokens' deepest planes do not exist yet while loop r < R
runs, so block positions are always read from plane r (Algorithm 1 line 5; with W >= γ this is exactly
Eq. 9, Proposition 1; with W < γ it is what "batched verification reads plane r there" describes).

Storage layout (per layer; the caller owns and fills it):
  deep_k, deep_v  [B, T, Hkv, D]       plane R of every cached position: entry [b, j] is position j of
                                       sequence b. Positions 0..t0−1 must be valid (and t0..t0+Tq−1 too
                                       when loop == P, see below).
  ring_k, ring_v  [B, P, C, Hkv, D]    planes 0..P−1 (the non-deepest loops, P = R − 1 in the paper) of
                                       the most recent positions: plane p of position j sits at slot
                                       j % C. The block's own plane-`loop` K/V must be written before
                                       the call. C >= W + Tq is required: the pass reads positions
                                       t0 − W .. t0 + Tq − 1 from the ring at once.
  cache_lens      int32 [B]            t0 per sequence (positions cached before the block)
  q               [B, Tq, H, D]        the block's queries at loop `loop`
  loop            int in [0, P]        the loop being run; loop == P is the deepest loop: every
                                       position, block included, is read from the deep plane (the
                                       caller writes the block's plane R there first)
  window          int W >= 0
  -> out [B, Tq, H, D] in q's dtype. Causal: query i sees positions <= t0 + i.
GQA: head h reads KV head h // (H // Hkv). Scores and softmax in fp32.
"""

from __future__ import annotations


import torch

from . import op_available

_OP_NAME = "ridgefill::ripe_attention"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)



def _check_args(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window) -> None:
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (deep_k, deep_v, ring_k, ring_v)):
        raise TypeError("ripe_attention: q and the planes must share a float dtype")
    if cache_lens.dtype != torch.int32:
        raise TypeError("ripe_attention: cache_lens must be int32")
    if q.dim() != 4 or deep_k.dim() != 4 or deep_k.shape != deep_v.shape or ring_k.dim() != 5 \
            or ring_k.shape != ring_v.shape:
        raise ValueError("ripe_attention: need q [B, Tq, H, D], deep_k = deep_v [B, T, Hkv, D], "
                         "ring_k = ring_v [B, P, C, Hkv, D]")
    batch, block_len, heads, head_dim = q.shape
    kv_heads = deep_k.shape[2]
    planes, capacity = ring_k.shape[1], ring_k.shape[2]
    if deep_k.shape[0] != batch or ring_k.shape[0] != batch or tuple(cache_lens.shape) != (batch,):
        raise ValueError("ripe_attention: batch sizes differ")
    if deep_k.shape[3] != head_dim or ring_k.shape[4] != head_dim or ring_k.shape[3] != kv_heads:
        raise ValueError("ripe_attention: head counts/dims of q, deep and ring planes differ")
    if kv_heads == 0 or heads % kv_heads or not 1 <= head_dim <= 256:
        raise ValueError(f"ripe_attention: H={heads} must be a multiple of Hkv={kv_heads}, D in [1, 256]")
    if window < 0 or not 0 <= loop <= planes:
        raise ValueError(f"ripe_attention: need window >= 0 and 0 <= loop <= P={planes}")
    if loop < planes and capacity < window + block_len:
        raise ValueError(f"ripe_attention: ring capacity C={capacity} must hold W + Tq = {window + block_len}")


def ripe_plane_of(t: torch.Tensor, j: torch.Tensor, t0: int, loop: int, planes: int, window: int) -> torch.Tensor:
    """True where query position t reads key position j from the ring (plane `loop`), False: deep plane."""
    if loop == planes:
        return torch.zeros(torch.broadcast_shapes(t.shape, j.shape), dtype=torch.bool, device=t.device)
    return (j >= t0) | (t - j <= window)


def ripe_attention_reference(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop: int, window: int,
                             scale: float) -> torch.Tensor:
    """Pure torch, one sequence at a time; fp32 scores/softmax. Returns [B, Tq, H, D] in q's dtype."""
    _check_args(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window)
    batch, block_len, heads, head_dim = q.shape
    kv_heads = deep_k.shape[2]
    planes, capacity = ring_k.shape[1], ring_k.shape[2]
    group = heads // kv_heads
    deep_only = loop == planes
    out = torch.zeros(batch, block_len, heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        t0 = int(cache_lens[b])
        n_keys = t0 + block_len
        need_deep = n_keys if deep_only else t0
        if t0 < 0 or deep_k.shape[1] < need_deep:
            raise ValueError(f"ripe_attention: sequence {b} needs {need_deep} deep positions, has {deep_k.shape[1]}")
        if block_len == 0:
            continue
        t = torch.arange(t0, n_keys, device=q.device)  # [Tq] query positions
        j = torch.arange(n_keys, device=q.device)  # [L] key positions
        from_ring = ripe_plane_of(t[:, None], j[None, :], t0, loop, planes, window)  # [Tq, L]
        deep_rows_k = deep_k[b, : min(n_keys, deep_k.shape[1])].float()
        deep_rows_v = deep_v[b, : min(n_keys, deep_v.shape[1])].float()
        pad = n_keys - deep_rows_k.shape[0]  # block positions absent from deep are never read from it
        deep_rows_k = torch.cat([deep_rows_k, deep_rows_k.new_zeros(pad, kv_heads, head_dim)])  # [L, Hkv, D]
        deep_rows_v = torch.cat([deep_rows_v, deep_rows_v.new_zeros(pad, kv_heads, head_dim)])
        if deep_only:
            ring_rows_k = ring_rows_v = deep_rows_k  # never selected
        else:
            ring_rows_k = ring_k[b, loop, j % capacity].float()  # [L, Hkv, D]
            ring_rows_v = ring_v[b, loop, j % capacity].float()
        # Per (query, key) choice of plane: [Tq, L, Hkv, D], then GQA expansion to H heads.
        sel = from_ring[:, :, None, None]
        k = torch.where(sel, ring_rows_k[None], deep_rows_k[None]).repeat_interleave(group, dim=2)  # [Tq, L, H, D]
        v = torch.where(sel, ring_rows_v[None], deep_rows_v[None]).repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,tlhd->thl", q[b].float(), k) * scale  # [Tq, H, L]
        causal = j[None, :] <= t[:, None]  # [Tq, L]
        probs = torch.softmax(scores.masked_fill(~causal[:, None, :], float("-inf")), dim=-1)
        out[b] = torch.einsum("thl,tlhd->thd", probs, v)
    return out.to(q.dtype)


if op_available("ripe_attention"):

    @torch.library.register_fake(_OP_NAME)
    def _fake(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window, scale):
        _check_args(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window)
        return q.new_empty(q.shape)

    @torch.library.register_kernel(_OP_NAME, "cpu")
    def _cpu(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window, scale):
        return ripe_attention_reference(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window, scale)

    _cuda_impl = torch.ops.ridgefill.ripe_attention.default
else:
    _cuda_impl = ripe_attention_reference


def ripe_attention(q: torch.Tensor, deep_k: torch.Tensor, deep_v: torch.Tensor, ring_k: torch.Tensor,
                   ring_v: torch.Tensor, cache_lens: torch.Tensor, loop: int, window: int,
                   scale: float) -> torch.Tensor:
    """Loop `loop` attention for a block of query tokens under the RIPE cache; see the module docstring."""
    if q.is_cuda:
        return _cuda_impl(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window, scale)
    return ripe_attention_reference(q, deep_k, deep_v, ring_k, ring_v, cache_lens, loop, window, scale)
