"""ripe_attention: one loop's attention for a block of query tokens, over caller-gathered loop planes.

A looped (recurrent-depth) model runs loops r = 0..R per token; each loop has its own K/V "plane".
Under the RIPE cache (seed 001 §4, Eq. 9) loop r of the token at position t reads cached position j
from plane r if t − j <= W and from the deepest plane R otherwise. This op does not know about loops
or planes: the caller (the cache manager) gathers the two planes a loop needs and passes

  q                [B, Tq, H, D]      the block's queries at this loop; query a sits at position
                                      t = t0 + a (a decode step: Tq = 1; a verification block: γ + 1)
  block_k, block_v [B, Tq, Hkv, D]    the block's own keys/values at this loop (position t0 + a at
                                      index a)
  deep_k, deep_v   [B, T, Hkv, D]     the far plane of the cached positions, by position: entry [b, j]
                                      is position j of sequence b (T >= max t0; rows >= t0 are never
                                      read)
  ring_k, ring_v   [B, C, Hkv, D]     the near plane of the recent cached positions: position j at
                                      slot j % C
  cache_lens       int32 [B]          t0 per sequence (positions cached before the block)
  window           int W >= 0         query t reads cached position j (< t0) from the ring if
                                      t − j <= W, else from deep
  scale            float              softmax scale (e.g. D ** -0.5)
  -> out [B, Tq, H, D] in q's dtype

Query a (t = t0 + a) sees key positions j <= t (causal), each read from
  j >= t0                  block[b, j − t0]
  j <  t0, t − j <= W      ring[b, j % C]
  j <  t0, t − j >  W      deep[b, j]
GQA: head h reads KV head h // (H // Hkv). Scores and softmax in float32 with the given scale.

Requirements (checked, with errors naming the problem): C >= W when W > 0, so that the positions
t0 − W .. t0 − 1 occupy distinct slots (with W == 0 the ring is never read and may be any
[B, C >= 1, Hkv, D]); H a multiple of Hkv; D in [1, 256]; all float tensors share one dtype among
float32/bfloat16/float16; cache_lens int32 [B]; batch sizes agree; T >= t0 for every sequence.
The last one depends on cache_lens' values: the reference (CPU) raises; the CUDA kernel does not
synchronise to check it and writes NaN for a sequence with t0 < 0 or t0 > T instead of reading out
of bounds. The CUDA kernel also needs deep/ring with a contiguous last dim (they are cache-sized, so
they are never copied silently).

How the runtime calls it, per cache kind (LoopPlanesCache in ridgefill_runtime/cache/spec.py):
  full cache (every plane of every position)  deep = plane r gathered, W = 0
  deepest-plane cache (plane R only)          deep = plane R gathered, W = 0
  RIPE(W)                                     deep = plane R gathered, ring = the sequence's ring of
                                              plane r (a ring of exactly W slots), window = W
  the deepest loop r = R (any kind)           deep = plane R gathered, W = 0
"""

from __future__ import annotations


import torch

from .extension import op_available

_OP_NAME = "ridgefill::ripe_attention"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_args(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window) -> None:
    """Shape/dtype contract shared by every path (the data-dependent T >= t0 lives in the reference)."""
    floats = {
        "q": q,
        "block_k": block_k,
        "block_v": block_v,
        "deep_k": deep_k,
        "deep_v": deep_v,
        "ring_k": ring_k,
        "ring_v": ring_v,
    }
    if q.dtype not in _DTYPES:
        raise TypeError(f"ripe_attention: q must be float32, bfloat16 or float16, got {q.dtype}")
    wrong = {name: t.dtype for name, t in floats.items() if t.dtype != q.dtype}
    if wrong:
        raise TypeError(f"ripe_attention: all float tensors must share q's dtype {q.dtype}; got {wrong}")
    if cache_lens.dtype != torch.int32:
        raise TypeError(f"ripe_attention: cache_lens must be int32, got {cache_lens.dtype}")
    bad_rank = [name for name, t in floats.items() if t.dim() != 4]
    if bad_rank:
        raise ValueError(
            f"ripe_attention: {', '.join(bad_rank)} must be 4-D: q [B, Tq, H, D], block_k/v "
            "[B, Tq, Hkv, D], deep_k/v [B, T, Hkv, D], ring_k/v [B, C, Hkv, D]"
        )
    for k_name, v_name in (("block_k", "block_v"), ("deep_k", "deep_v"), ("ring_k", "ring_v")):
        if floats[k_name].shape != floats[v_name].shape:
            raise ValueError(
                f"ripe_attention: {k_name} {tuple(floats[k_name].shape)} and {v_name} "
                f"{tuple(floats[v_name].shape)} differ in shape"
            )
    batch, block_len, heads, head_dim = q.shape
    kv_heads = block_k.shape[2]
    capacity = ring_k.shape[1]
    if cache_lens.dim() != 1 or any(t.shape[0] != batch for t in (block_k, deep_k, ring_k, cache_lens)):
        raise ValueError(
            f"ripe_attention: batch sizes differ: q {batch}, block {block_k.shape[0]}, deep "
            f"{deep_k.shape[0]}, ring {ring_k.shape[0]}, cache_lens {tuple(cache_lens.shape)}"
        )
    if block_k.shape[1] != block_len:
        raise ValueError(f"ripe_attention: block_k/v hold {block_k.shape[1]} tokens, q has Tq={block_len}")
    if any(t.shape[2] != kv_heads for t in (deep_k, ring_k)) or any(
        t.shape[3] != head_dim for t in (block_k, deep_k, ring_k)
    ):
        raise ValueError(
            f"ripe_attention: [Hkv, D] of block {tuple(block_k.shape[2:])}, deep "
            f"{tuple(deep_k.shape[2:])}, ring {tuple(ring_k.shape[2:])} and q's D={head_dim} differ"
        )
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"ripe_attention: H={heads} must be a multiple of Hkv={kv_heads}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"ripe_attention: head dim D must be in [1, 256], got {head_dim}")
    if window < 0:
        raise ValueError(f"ripe_attention: window W must be >= 0, got {window}")
    if capacity < 1:
        raise ValueError("ripe_attention: ring_k/v need at least one slot (C >= 1), even when W == 0")
    if window > 0 and capacity < window:
        raise ValueError(
            f"ripe_attention: ring capacity C={capacity} < window W={window}: positions t0-W..t0-1 "
            "must occupy distinct slots (need C >= W)"
        )


def ripe_attention_reference(
    q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window: int, scale: float
) -> torch.Tensor:
    """Pure torch, one sequence at a time; fp32 scores/softmax. Returns [B, Tq, H, D] in q's dtype."""
    _check_args(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window)
    batch, block_len, heads, head_dim = q.shape
    group = heads // block_k.shape[2]
    deep_len, capacity = deep_k.shape[1], ring_k.shape[1]
    out = torch.zeros(batch, block_len, heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        t0 = int(cache_lens[b])
        if not 0 <= t0 <= deep_len:
            raise ValueError(
                f"ripe_attention: sequence {b} has t0={t0} cached positions; deep_k/v hold T={deep_len} "
                "(need 0 <= t0 <= T)"
            )
        if block_len == 0:
            continue
        t = torch.arange(t0, t0 + block_len, device=q.device)  # [Tq] query positions
        j = torch.arange(t0, device=q.device)  # [t0] cached key positions
        # Cached keys: per (query, key) either the ring's slot j % C or the deep row j.
        from_ring = (t[:, None] - j[None, :] <= window)[:, :, None, None]  # [Tq, t0, 1, 1]
        deep_rows_k, deep_rows_v = deep_k[b, :t0].float(), deep_v[b, :t0].float()  # [t0, Hkv, D]
        if window > 0:
            ring_rows_k, ring_rows_v = ring_k[b, j % capacity].float(), ring_v[b, j % capacity].float()
        else:  # t - j >= 1 > W for every cached key: the ring is never read
            ring_rows_k, ring_rows_v = deep_rows_k, deep_rows_v
        cached_k = torch.where(from_ring, ring_rows_k[None], deep_rows_k[None])  # [Tq, t0, Hkv, D]
        cached_v = torch.where(from_ring, ring_rows_v[None], deep_rows_v[None])
        # Block keys: position t0 + c at index c, the same for every query (causality masks the rest).
        own_k = block_k[b].float()[None].expand(block_len, -1, -1, -1)  # [Tq, Tq, Hkv, D]
        own_v = block_v[b].float()[None].expand(block_len, -1, -1, -1)
        k = torch.cat([cached_k, own_k], dim=1).repeat_interleave(group, dim=2)  # [Tq, L, H, D], L = t0 + Tq
        v = torch.cat([cached_v, own_v], dim=1).repeat_interleave(group, dim=2)
        scores = torch.einsum("ahd,alhd->ahl", q[b].float(), k) * scale  # [Tq, H, L]
        causal = torch.arange(t0 + block_len, device=q.device)[None, :] <= t[:, None]  # [Tq, L]
        probs = torch.softmax(scores.masked_fill(~causal[:, None, :], float("-inf")), dim=-1)
        out[b] = torch.einsum("ahl,alhd->ahd", probs, v)
    return out.to(q.dtype)


if op_available("ripe_attention"):

    @torch.library.register_fake(_OP_NAME)
    def _fake(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window, scale):
        _check_args(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window)
        return q.new_empty(q.shape)

    @torch.library.register_kernel(_OP_NAME, "cpu")
    def _cpu(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window, scale):
        return ripe_attention_reference(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window, scale)

    _cuda_impl = torch.ops.ridgefill.ripe_attention.default
else:
    _cuda_impl = ripe_attention_reference


def ripe_attention(
    q: torch.Tensor,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    deep_k: torch.Tensor,
    deep_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    cache_lens: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """One loop's attention for a block of Tq query tokens per sequence; see the module docstring."""
    if q.is_cuda:
        return _cuda_impl(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window, scale)
    return ripe_attention_reference(q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, cache_lens, window, scale)
