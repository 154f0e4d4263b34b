"""Achieved rates of the ridgefill CUDA kernels against what the device itself measures, same run.

    python benchmarks/cuda_kernels.py            # needs a CUDA device and the compiled extension
    python benchmarks/cuda_kernels.py --quick    # fewer sizes

Two device ceilings are measured first: copy bandwidth (a large device-to-device `copy_`, bytes read
+ written) and the bf16 GEMM rate (`torch.matmul`) at each GEMM shape used below. Each kernel is then
timed with CUDA events (median of several runs after warm-up) and reported as
  * bandwidth-bound shapes (decode, GEMV, GDN step): the minimum bytes the op must move / time,
    as a fraction of copy bandwidth;
  * compute-bound shapes (int8 GEMM at large M): 2·M·N·K / time, as a fraction of the bf16 GEMM
    rate on the same shape (x @ w_bf16.T, with the bf16 weights already in memory).
Goals (issue 5): int8_map_gemm >= 70% of bf16 GEMM at M >= 2048; attention >= 60% of copy bandwidth
on decode-like shapes. The table says which rows meet them; this script never asserts.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def timed(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    n = 1 << 29  # 1 GiB of bf16 per buffer: far beyond L2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), reps=10)
    return 2 * n * 2 / t  # bytes read + written per second


def gemm_rate(m: int, n: int, k: int) -> float:
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    t = timed(lambda: a @ w.T)
    return 2 * m * n * k / t


ROWS: list[tuple] = []


def report(kernel: str, shape: str, seconds: float, achieved: float, ceiling: float, unit: str, goal: float | None):
    ratio = achieved / ceiling
    verdict = "" if goal is None else ("meets" if ratio >= goal else f"below {goal:.0%}")
    ROWS.append(
        (
            kernel,
            shape,
            f"{seconds * 1e6:9.1f}",
            f"{achieved / 1e12 if unit == 'TFLOP/s' else achieved / 1e9:9.1f}",
            unit,
            f"{ratio:6.1%}",
            verdict,
        )
    )


def bench_int8(copy_bw: float, quick: bool):
    from ridgefill_runtime.ops import quantize_int8_groupwise

    d_in, d_out = 5120, 5120  # a 27B-class hidden size; one late-layer map
    w = torch.randn(d_out, d_in, device="cuda") * 0.02
    qweight, scales = quantize_int8_groupwise(w)
    bias = torch.zeros(d_out, dtype=torch.bfloat16, device="cuda")
    w_bf16 = w.to(torch.bfloat16)
    for m in [1, 8, 2048] if quick else [1, 4, 8, 256, 2048, 8192]:
        x = torch.randn(m, d_in, dtype=torch.bfloat16, device="cuda")
        t = timed(lambda: torch.ops.ridgefill.int8_map_gemm(x, qweight, scales, bias))
        if m <= 8:  # GEMV path: weight streaming
            moved = d_out * d_in + scales.numel() * 2 + m * (d_in + d_out) * 2
            report("int8_map_gemm", f"M={m} {d_out}x{d_in}", t, moved / t, copy_bw, "GB/s", None)
        else:
            flops = 2 * m * d_out * d_in
            ref = 2 * m * d_out * d_in / timed(lambda: x @ w_bf16.T)
            report("int8_map_gemm", f"M={m} {d_out}x{d_in}", t, flops / t, ref, "TFLOP/s", 0.7 if m >= 2048 else None)


def _paged(batch, ctx, kv_heads, head_dim, block_size=16):
    blocks = (ctx + block_size - 1) // block_size
    perm = torch.randperm(batch * blocks, device="cuda").to(torch.int32).view(batch, blocks)
    slots = batch * blocks * block_size
    k = torch.randn(slots, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    return k, v, perm, torch.full((batch,), ctx, dtype=torch.int32, device="cuda")


def bench_scattered(copy_bw: float, quick: bool):
    heads, kv_heads, head_dim = 32, 8, 128
    shapes = [(32, 4096, 1), (8, 16384, 1)] if quick else [(32, 2048, 1), (32, 8192, 1), (8, 32768, 1), (1, 16384, 256)]
    for batch, ctx, rows_per_seq in shapes:
        k, v, tables, lens = _paged(batch, ctx, kv_heads, head_dim)
        q_seq = torch.arange(batch, device="cuda", dtype=torch.int32).repeat_interleave(rows_per_seq)
        q_pos = (ctx - rows_per_seq + torch.arange(rows_per_seq, device="cuda")).repeat(batch)
        q = torch.randn(batch * rows_per_seq, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        mass = rows_per_seq > 1  # the probe-shaped case also returns key mass
        t = timed(
            lambda: torch.ops.ridgefill.scattered_rows_attention(
                q, q_seq, q_pos, k, v, tables, lens, 16, head_dim**-0.5, mass
            )
        )
        shape = f"B={batch} ctx={ctx} rows/seq={rows_per_seq}{' +mass' if mass else ''}"
        if rows_per_seq == 1:  # decode-like: bandwidth-bound, each K and V row read once
            moved = batch * ctx * kv_heads * head_dim * 2 * 2
            report("scattered_rows_attention", shape, t, moved / t, copy_bw, "GB/s", 0.6)
        else:  # probe-like: many rows over one context; compute-bound (QK, PV, and QK again for the mass)
            flops = 2 * 3 * batch * rows_per_seq * heads * ctx * head_dim
            report("scattered_rows_attention", shape, t, flops / t, gemm_rate(4096, 4096, 4096), "TFLOP/s", None)


def bench_ripe(copy_bw: float, quick: bool):
    # RIPE(W) as the runtime calls it: deep = plane R gathered for the cached positions, ring = the
    # sequence's ring of plane r (exactly W slots), block = this loop's K/V of the Tq block tokens.
    heads, kv_heads, head_dim, window = 32, 8, 128, 64
    for batch, ctx, block in [(32, 4096, 1)] if quick else [(32, 4096, 1), (8, 16384, 1), (32, 4096, 5)]:
        deep_k = torch.randn(batch, ctx, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        deep_v = torch.randn_like(deep_k)
        ring_k = torch.randn(batch, window, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        ring_v = torch.randn_like(ring_k)
        block_k = torch.randn(batch, block, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        block_v = torch.randn_like(block_k)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, block, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        t = timed(
            lambda: torch.ops.ridgefill.ripe_attention(
                q, block_k, block_v, deep_k, deep_v, ring_k, ring_v, lens, window, head_dim**-0.5
            )
        )
        moved = batch * (ctx + block) * kv_heads * head_dim * 2 * 2  # each key's K and V row read once
        report(
            "ripe_attention",
            f"B={batch} ctx={ctx} Tq={block} W={window}",
            t,
            moved / t,
            copy_bw,
            "GB/s",
            0.6 if block == 1 else None,
        )


def bench_gdn(copy_bw: float, quick: bool):
    k_heads, v_heads, k_dim, v_dim = 16, 32, 128, 128  # Qwen3-Next linear-attention shape
    for batch in [64] if quick else [8, 64]:
        q = torch.randn(batch, k_heads, k_dim, dtype=torch.bfloat16, device="cuda")
        k = torch.randn_like(q)
        v = torch.randn(batch, v_heads, v_dim, dtype=torch.bfloat16, device="cuda")
        g = -torch.rand(batch, v_heads, device="cuda")
        beta = torch.rand(batch, v_heads, dtype=torch.bfloat16, device="cuda")
        state = torch.randn(batch, v_heads, k_dim, v_dim, device="cuda")
        t = timed(lambda: torch.ops.ridgefill.gdn_step(q, k, v, g, beta, state, True))
        moved = 2 * state.numel() * 4  # the fp32 state is read and written once
        report("gdn_step", f"B={batch} Hv={v_heads} {k_dim}x{v_dim}", t, moved / t, copy_bw, "GB/s", None)
    for seq_len in [4096] if quick else [1024, 8192]:
        q = torch.randn(1, seq_len, k_heads, k_dim, dtype=torch.bfloat16, device="cuda")
        k = torch.randn_like(q)
        v = torch.randn(1, seq_len, v_heads, v_dim, dtype=torch.bfloat16, device="cuda")
        g = -torch.rand(1, seq_len, v_heads, device="cuda")
        beta = torch.rand(1, seq_len, v_heads, dtype=torch.bfloat16, device="cuda")
        t = timed(lambda: torch.ops.ridgefill.gdn_chunk(q, k, v, g, beta, None, True), reps=5)
        flops = seq_len * v_heads * k_dim * v_dim * 6  # two mat-vecs and a rank-1 update per token
        ref = gemm_rate(4096, 4096, 4096)
        report("gdn_chunk (scan)", f"B=1 T={seq_len} Hv={v_heads}", t, flops / t, ref, "TFLOP/s", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_kernels.py needs a CUDA device")
    import ridgefill_runtime.ops as ops

    if not ops.extension_loaded():
        raise SystemExit(f"compiled extension not loaded: {ops.extension_error()}")
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    print(
        f"device: {torch.cuda.get_device_name()}  copy bandwidth: {copy_bw / 1e9:.0f} GB/s  "
        f"bf16 GEMM 8192^3: {gemm_rate(8192, 8192, 8192) / 1e12:.0f} TFLOP/s"
    )
    with torch.inference_mode():
        bench_int8(copy_bw, args.quick)
        bench_scattered(copy_bw, args.quick)
        bench_ripe(copy_bw, args.quick)
        bench_gdn(copy_bw, args.quick)
    header = ("kernel", "shape", "time us", "achieved", "unit", "of ceil", "goal")
    widths = [max(len(str(r[i])) for r in [header, *ROWS]) for i in range(len(header))]
    for row in [header, *ROWS]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print(
        "ceiling: copy bandwidth for GB/s rows; bf16 torch.matmul on the same shape (int8 GEMM) or at 4096^3 "
        "(GDN scan) for TFLOP/s rows"
    )


if __name__ == "__main__":
    main()
