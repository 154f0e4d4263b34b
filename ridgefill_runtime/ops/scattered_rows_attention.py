"""scattered_rows_attention: attention for an arbitrary subset of prompt rows over the paged KV cache.

The rows are whatever the fill chose to run exactly (seed 000 §2.4: exact prefix rows, the tail, the
probe's last rows) from several sequences, each attending causally *by its original position* to its
sequence's keys in the runtime's cache (ridgefill_runtime/cache/kv_pool.py):

  q            [R, H, D]            the rows' queries (any float dtype; k/v share it, or q is float32 over
                                    bfloat16/float16 slabs: a narrower K/V cache; q and out stay float32;
                                    or q is float32 over int8 slabs with k_scale/v_scale, below)
  q_seq        int32 [R]            sequence (batch index b) of each row
  q_pos        int64 [R]            position of each row in its sequence; it sees keys 0..q_pos, or with a
                                    sliding window (window > 0) only max(0, q_pos - window + 1)..q_pos
  k_slab/v_slab [S, Hkv, D]         one layer's cache slabs; position p of sequence b lives at slot
                                    block_tables[b, p // block_size] * block_size + p % block_size
  k_scale/v_scale float32 [S, Hkv, G]  int8 slabs only (cache.kv_dtype = "int8", cache/int8_kv.py): value d
                                    of row (slot, h) is float(k_slab[slot, h, d]) * k_scale[slot, h, d // 32]
  block_tables int32 [B, max_blocks]
  context_lens int32 [B]            keys written for each sequence; q_pos < context_lens[q_seq]
  window       int                  0: full causal attention; > 0: sliding window (Gemma 3's local layers), a row
                                    at p sees the keys j with p - j < window. Keys outside every row's window are
                                    never read (a sliding-window cache may have recycled their slots: NaN there
                                    must not leak)
  -> out [R, H, D] in q's dtype, and key_mass float32 [B, max_blocks * block_size] when requested:
     key_mass[b, j] = sum over b's rows and all H heads of the softmax probability of key j (entries
     at j >= context_lens[b] are 0; a row adds nothing to keys outside its window). That is what the probe
     selector ranks prefix rows by.

GQA: head h reads KV head h // (H // Hkv) (transformers' repeat_kv). Scores and softmax in fp32.
Rows are usually sorted by (seq, pos) but need not be. An empty subset returns empty outputs.

Kernels: csrc/scattered_rows_attention.cu (CUDA/HIP) and csrc/cpu/scattered_rows_attention_cpu.cpp (CPU: the
runtime's batched paged attention, every decode, prefill-chunk and scattered row of all sequences in one call,
reading K/V in place). Without the compiled extension every device runs scattered_rows_attention_reference, which
the tests also use as the pure-torch reference. int8 slabs: the CPU kernel's ridgefill::scattered_rows_attention_int8
(dequantized in registers) or the reference; no CUDA kernel reads them (cache/build.py refuses the setting there).
"""

from __future__ import annotations


import torch

from ..cache import int8_kv
from .extension import op_available

_OP_NAME = "ridgefill::scattered_rows_attention"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_scales(q, k_slab, k_scale, v_scale) -> None:
    """int8 slabs come with float32 scales [S, Hkv] (and only they do)."""
    if k_slab.dtype != torch.int8:
        if k_scale is not None or v_scale is not None:
            raise TypeError("scattered_rows_attention: k_scale/v_scale go with int8 slabs only")
        return
    if q.dtype != torch.float32 or k_scale is None or v_scale is None:
        raise TypeError("scattered_rows_attention: int8 slabs need float32 queries and k_scale/v_scale")
    for s in (k_scale, v_scale):
        want = (*k_slab.shape[:2], int8_kv.groups(k_slab.shape[2]))
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(
                f"scattered_rows_attention: k_scale/v_scale must be float32 [S, Hkv, G] = {want}; "
                f"got {s.dtype} {tuple(s.shape)}"
            )


def _check_args(
    q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, window, k_scale=None, v_scale=None
) -> None:
    """Shape/dtype contract shared by every path (data-dependent checks live in the reference)."""
    mixed = q.dtype == torch.float32 and k_slab.dtype in (*_DTYPES, torch.int8)
    if q.dtype not in _DTYPES or (k_slab.dtype != q.dtype and not mixed) or v_slab.dtype != k_slab.dtype:
        raise TypeError(
            f"scattered_rows_attention: q, k_slab, v_slab must share a float dtype (or q be float32 "
            f"over bfloat16/float16/int8 slabs); got {q.dtype}, {k_slab.dtype}, {v_slab.dtype}"
        )
    _check_scales(q, k_slab, k_scale, v_scale)
    if q_seq.dtype != torch.int32 or q_pos.dtype != torch.int64:
        raise TypeError("scattered_rows_attention: q_seq must be int32 and q_pos int64")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError("scattered_rows_attention: block_tables and context_lens must be int32")
    if q.dim() != 3 or k_slab.dim() != 3 or k_slab.shape != v_slab.shape:
        raise ValueError(
            f"scattered_rows_attention: need q [R, H, D], k_slab = v_slab [S, Hkv, D]; got "
            f"{tuple(q.shape)}, {tuple(k_slab.shape)}, {tuple(v_slab.shape)}"
        )
    rows, heads, head_dim = q.shape
    kv_heads = k_slab.shape[1]
    if k_slab.shape[2] != head_dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"scattered_rows_attention: H={heads} must be a multiple of Hkv={kv_heads} and head dims "
            f"must match ({head_dim} vs {k_slab.shape[2]})"
        )
    if not 1 <= head_dim <= 256:
        raise ValueError(f"scattered_rows_attention: head dim must be in [1, 256], got {head_dim}")
    if tuple(q_seq.shape) != (rows,) or tuple(q_pos.shape) != (rows,):
        raise ValueError("scattered_rows_attention: q_seq and q_pos must be [R]")
    if block_tables.dim() != 2 or tuple(context_lens.shape) != (block_tables.shape[0],):
        raise ValueError("scattered_rows_attention: need block_tables [B, max_blocks] and context_lens [B]")
    if block_size < 1:
        raise ValueError("scattered_rows_attention: block_size must be positive")
    # bool is an int subclass, but window=True is surely a mix-up with return_key_mass.
    if isinstance(window, bool) or not isinstance(window, (int, torch.SymInt)):
        raise TypeError(
            f"scattered_rows_attention: window must be an int (0 = no sliding window), got {type(window).__name__}"
        )
    if window < 0:
        raise ValueError(f"scattered_rows_attention: window must be >= 0 (0 = no sliding window), got {window}")


def scattered_rows_attention_reference(
    q,
    q_seq,
    q_pos,
    k_slab,
    v_slab,
    block_tables,
    context_lens,
    block_size: int,
    scale: float,
    return_key_mass: bool = False,
    window: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """Pure torch; one sequence at a time, fp32 scores/softmax/weighted sum. Returns (out, key_mass).

    Each sequence gathers only the keys some row of it can see (the union of the rows' windows): a key no row
    sees may be NaN, and masking it afterwards would not help (0 * NaN in the weighted sum is NaN)."""
    _check_args(q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, window, k_scale, v_scale)
    rows, heads, head_dim = q.shape
    batch, max_blocks = block_tables.shape
    kv_heads = k_slab.shape[1]
    group = heads // kv_heads
    max_ctx = max_blocks * block_size
    out = torch.zeros(rows, heads, head_dim, dtype=torch.float32, device=q.device)  # [R, H, D]
    key_mass = (
        torch.zeros(batch, max_ctx, dtype=torch.float32, device=q.device)
        if return_key_mass
        else torch.empty(0, dtype=torch.float32, device=q.device)
    )
    if rows == 0:
        return out.to(q.dtype), key_mass
    lens = context_lens.long()
    if bool((q_seq < 0).any()) or bool((q_seq >= batch).any()):
        raise ValueError("scattered_rows_attention: q_seq out of range")
    if bool((q_pos < 0).any()) or bool((q_pos >= lens[q_seq.long()]).any()):
        raise ValueError("scattered_rows_attention: every q_pos must be in [0, context_lens[q_seq])")
    if bool((lens > max_ctx).any()):
        raise ValueError("scattered_rows_attention: a context is longer than its block table")
    for b in torch.unique(q_seq).tolist():
        pick = (q_seq == b).nonzero().flatten()  # [Rb]
        last = q_pos[pick]  # [Rb] each row's last visible key
        first = (last - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(last)  # [Rb]
        n_keys = int(last.max()) + 1
        # Keys seen by at least one row: +1 where a row's range starts, -1 past its end, running sum > 0.
        starts = torch.zeros(n_keys + 1, dtype=torch.long, device=q.device)
        starts.index_add_(0, first, torch.ones_like(first))
        starts.index_add_(0, last + 1, -torch.ones_like(last))
        pos = (starts[:n_keys].cumsum(0) > 0).nonzero().flatten()  # [L] key positions, ascending
        slots = block_tables[b].long()[pos // block_size] * block_size + pos % block_size  # [L]
        k, v = k_slab.index_select(0, slots), v_slab.index_select(0, slots)  # [L, Hkv, D]
        if k_scale is not None:  # int8 slabs: float(q) * scale, as every reader dequantizes (cache/int8_kv.py)
            k, v = (
                int8_kv.dequantize(k, k_scale.index_select(0, slots)),
                int8_kv.dequantize(v, v_scale.index_select(0, slots)),
            )
        k, v = k.float(), v.float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        qb = q[pick].float()  # [Rb, H, D]
        scores = torch.einsum("rhd,lhd->rhl", qb, k) * scale  # [Rb, H, L]
        visible = (pos[None, :] <= last[:, None]) & (pos[None, :] >= first[:, None])  # [Rb, L]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Rb, H, L]
        out[pick] = torch.einsum("rhl,lhd->rhd", probs, v)
        if return_key_mass:
            key_mass[b].index_add_(0, pos, probs.sum(dim=(0, 1)))
    return out.to(q.dtype), key_mass


if op_available("scattered_rows_attention"):

    @torch.library.register_fake(_OP_NAME)
    def _fake(
        q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass, window=0
    ):
        _check_args(q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, window)
        out = q.new_empty(q.shape)
        if return_key_mass:
            mass = q.new_empty((block_tables.shape[0], block_tables.shape[1] * block_size), dtype=torch.float32)
        else:
            mass = q.new_empty((0,), dtype=torch.float32)
        return out, mass

    _compiled = torch.ops.ridgefill.scattered_rows_attention.default
    # csrc/cpu/scattered_rows_attention_cpu.cpp; a _C built before that file existed has no CPU kernel.
    _CPU_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, "CPU")
else:
    _compiled = scattered_rows_attention_reference
    _CPU_KERNEL = False

# int8 slabs: a CPU-only op of its own (its schema takes the scales; the CUDA kernel's stays as it is).
_INT8_KERNEL = op_available("scattered_rows_attention_int8")
if _INT8_KERNEL:

    @torch.library.register_fake(_OP_NAME + "_int8")
    def _fake_int8(
        q, q_seq, q_pos, k_slab, v_slab, k_scale, v_scale, block_tables, context_lens, block_size, scale,
        return_key_mass, window=0,
    ):  # fmt: skip
        return _fake(
            q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass, window
        )


def compiled_for(device: torch.device) -> bool:
    """A compiled kernel serves this device (else every call runs the per-sequence reference)."""
    return _compiled is not scattered_rows_attention_reference and (device.type == "cuda" or _CPU_KERNEL)


def scattered_rows_attention(
    q: torch.Tensor,
    q_seq: torch.Tensor,
    q_pos: torch.Tensor,
    k_slab: torch.Tensor,
    v_slab: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    return_key_mass: bool = False,
    window: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [R, H, D], key_mass [B, max_blocks*block_size] or empty); see the module docstring."""
    if k_slab.dtype == torch.int8:
        return _int8(
            q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass, window,
            k_scale, v_scale,
        )  # fmt: skip
    if k_scale is not None or v_scale is not None:
        _check_scales(q, k_slab, k_scale, v_scale)
    if q.is_cuda and q.dtype != k_slab.dtype:
        # NOTE: the CUDA kernel takes one dtype: the queries are rounded to the slabs' (the CPU kernel
        # reads float32 queries over a narrower cache as they are)
        out, mass = scattered_rows_attention(
            q.to(k_slab.dtype),
            q_seq,
            q_pos,
            k_slab,
            v_slab,
            block_tables,
            context_lens,
            block_size,
            scale,
            return_key_mass,
            window,
        )
        return out.to(q.dtype), mass
    if q.is_cuda or (_CPU_KERNEL and q.device.type == "cpu"):
        # The kernels check window >= 0 too; checking here names the argument the same way on every path.
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            _check_args(q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, window)
        return _compiled(
            q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass, window
        )
    return scattered_rows_attention_reference(
        q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass, window
    )


def _int8(q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass, window,
          k_scale, v_scale):  # fmt: skip
    """int8 slabs: the CPU kernel where it is built, else the reference; never a CUDA kernel."""
    if q.is_cuda:
        raise TypeError(
            "scattered_rows_attention: no CUDA kernel reads int8 K/V slabs (cache.kv_dtype int8 is CPU only)"
        )
    if q.dtype in (torch.bfloat16, torch.float16):  # NOTE: a half model: queries widened, output rounded back
        out, mass = _int8(
            q.float(), q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass,
            window, k_scale, v_scale,
        )  # fmt: skip
        return out.to(q.dtype), mass
    if _INT8_KERNEL and q.device.type == "cpu":
        # NOTE: the kernel checks the rest (per layer and step, the Python checks cost more than a short decode)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0 or k_scale is None:
            _check_args(
                q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, window, k_scale, v_scale
            )
        return torch.ops.ridgefill.scattered_rows_attention_int8(
            q, q_seq, q_pos, k_slab, v_slab, k_scale, v_scale, block_tables, context_lens, block_size, scale,
            return_key_mass, window,
        )  # fmt: skip
    return scattered_rows_attention_reference(
        q, q_seq, q_pos, k_slab, v_slab, block_tables, context_lens, block_size, scale, return_key_mass, window,
        k_scale, v_scale,
    )  # fmt: skip
