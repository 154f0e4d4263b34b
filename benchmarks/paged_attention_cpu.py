"""Batched paged attention on CPU: the compiled ridgefill::scattered_rows_attention CPU kernel
(csrc/cpu/scattered_rows_attention_cpu.cpp) against the torch reference and against the per-sequence
gather + F.scaled_dot_product_attention loop (what ridgefill_runtime/layers/attention.py does on CPU).

    python benchmarks/paged_attention_cpu.py                 # 2 threads, SmolLM2-135M attention shape, fp32
    python benchmarks/paged_attention_cpu.py --threads 8 --context 4096 --dtype bfloat16

B decode rows (one per sequence, each at the end of its own context of --context keys) in one call, the
sequences' blocks shuffled over one KV slab as in the runtime's pool. Each row of the table is the median of
--reps timed calls after warm-up; "GB/s" is the K/V bytes the call must read (B x context x Hkv x D x 2 x
itemsize) over the kernel's time. A last row times a prefill chunk (--prefill rows of one sequence, the end of
its context) for comparison. Only the outputs' agreement with the SDPA loop is checked; timings never assert.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ridgefill_runtime import ops
from ridgefill_runtime.layers.attention import attend
from ridgefill_runtime.ops import scattered_rows_attention_reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_batch(batch, context, heads, kv_heads, head_dim, block_size, dtype, rows_per_seq=1, seed=0):
    """B sequences of `context` keys in shuffled blocks; the last rows_per_seq positions of each are queries."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-context // block_size)
    num_blocks = batch * max_blocks + 8
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    k_slab = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_slab = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    ctx = torch.full((batch,), context, dtype=torch.int32)
    q_seq = torch.arange(batch, dtype=torch.int32).repeat_interleave(rows_per_seq)
    q_pos = torch.arange(context - rows_per_seq, context, dtype=torch.int64).repeat(batch)
    q = torch.randn(batch * rows_per_seq, heads, head_dim, generator=gen).to(dtype)
    pos = torch.arange(context)
    slots = [tables[b].long()[pos // block_size] * block_size + pos % block_size for b in range(batch)]
    return (q, q_seq, q_pos, k_slab, v_slab, tables, ctx), slots


def sdpa_loop(q, k_slab, v_slab, slots, rows_per_seq, scale):
    """Per sequence: gather its K/V by slot, then SDPA (the runtime's CPU path today)."""
    outs = []
    for b, s in enumerate(slots):
        lo = b * rows_per_seq
        outs.append(attend(q[lo : lo + rows_per_seq], k_slab[s], v_slab[s], scale))
    return torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--prefill", type=int, default=128, help="rows of the prefill-chunk case (0: skip)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    scale = args.head_dim**-0.5
    has_kernel = ops.extension_loaded() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "ridgefill::scattered_rows_attention", "CPU"
    )
    if not has_kernel:
        raise SystemExit("ridgefill_runtime._C has no CPU scattered_rows_attention: build the extension first")
    kernel = torch.ops.ridgefill.scattered_rows_attention

    print(
        f"threads {torch.get_num_threads()}, H {args.heads} / Hkv {args.kv_heads} / D {args.head_dim}, "
        f"{args.dtype}, context {args.context}, block size {args.block_size}"
    )
    print(
        f"{'case':>22} {'kernel ms':>10} {'GB/s':>7} {'reference ms':>13} {'speed-up':>9} "
        f"{'gather+SDPA ms':>15} {'speed-up':>9}"
    )
    cases = [(b, 1) for b in args.batches] + ([(1, args.prefill)] if args.prefill else [])
    for batch, rows_per_seq in cases:
        inputs, slots = make_batch(
            batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype, rows_per_seq
        )
        q, _, _, k_slab, v_slab, _, _ = inputs
        call = (*inputs, args.block_size, scale, False)
        out = kernel(*call)[0]
        expected = sdpa_loop(q, k_slab, v_slab, slots, rows_per_seq, scale).view_as(out)
        err = (out.float() - expected.float()).abs().max().item()
        assert err < (1e-4 if dtype == torch.float32 else 3e-2), err  # sanity, not a test
        t_kernel = timed(lambda: kernel(*call), args.reps)
        reps_ref = max(3, args.reps // 4)
        t_ref = timed(lambda: scattered_rows_attention_reference(*call), reps_ref)
        t_sdpa = timed(lambda: sdpa_loop(q, k_slab, v_slab, slots, rows_per_seq, scale), args.reps)
        gbs = batch * args.context * args.kv_heads * args.head_dim * 2 * k_slab.element_size() / t_kernel / 1e9
        name = f"B={batch} decode" if rows_per_seq == 1 else f"prefill {rows_per_seq} rows"
        print(
            f"{name:>22} {t_kernel * 1e3:>10.3f} {gbs:>7.1f} {t_ref * 1e3:>13.3f} {t_ref / t_kernel:>8.1f}x "
            f"{t_sdpa * 1e3:>15.3f} "
            f"{t_sdpa / t_kernel:>8.1f}x"
        )


if __name__ == "__main__":
    main()
