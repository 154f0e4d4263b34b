"""One layer's prefill attention at long prompts, in the shapes of the models we serve:
torch's SDPA fused CPU kernel (a blocked flash-style loop with an online softmax; the path
`layers/attention.attend` takes) against SDPA's unfused math path, and for a sliding-window
layer the banded path (layers/window_attention.py) against the whole-mask path it replaced.

    python benchmarks/prefill_attention.py --threads 2 --lengths 4096 8192 16384 32768

Each arm's output is checked against a float64 loop on a sample of rows before it is timed.
Arms whose memory grows as L^2 stop at --math-max (the math path) and --mask-max (the whole mask).
FLOPs count only the score and value products a row needs (its causal or window keys), so
`of FMA peak` says how close each arm comes to this machine's measured FMA loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ridgefill_runtime.layers.attention import attend
from ridgefill_runtime.layers.window_attention import banded_window_attention

# (heads, kv heads, head dim, window) per served model's layer kinds
SHAPES = {
    "gemma3-270m global": (4, 1, 256, 0),
    "gemma3-270m local": (4, 1, 256, 512),
    "qwen2.5-coder-0.5b": (14, 2, 64, 0),
}


def sdpa(q, k, v, scale, window, backend):
    """q [L, H, D], k/v [L, Hkv, D] -> [L, H*D]; backend: fused (torch's flash CPU kernel) or math."""
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    if backend == "math":  # NOTE: the math path takes no enable_gqa; repeat the K/V heads
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH if backend == "math" else SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=rep > 1 and backend != "math"
        )
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def whole_mask(q, k, v, scale, window):
    """The path windowed layers took before bands: SDPA over one [L, L] mask."""
    pos = torch.arange(q.shape[0])
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)  # [L, L]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def reference_rows(q, k, v, scale, window, rows):
    """float64 outputs of the chosen rows [R] -> [R, H*D]."""
    group = q.shape[1] // k.shape[1]
    out = []
    for r in rows.tolist():
        lo = max(r - window + 1, 0) if window else 0
        kk = k[lo : r + 1].double().repeat_interleave(group, 1)  # [n, H, D]
        vv = v[lo : r + 1].double().repeat_interleave(group, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[r].double(), kk) * scale, dim=-1)  # [H, n]
        out.append(torch.einsum("hn,nhd->hd", w, vv).reshape(-1))
    return torch.stack(out)


def attention_flops(n: int, heads: int, dim: int, window: int) -> float:
    keys = sum(min(p + 1, window) if window else p + 1 for p in range(n))
    return 4.0 * keys * heads * dim  # QK^T and PV, a multiply-add each


def arms(window: int, n: int, mask_max: int, math_max: int):
    if window:
        pos = torch.arange(n)
        yield "banded (ours)", lambda q, k, v, s: banded_window_attention(q, pos, k, v, pos, s, window)
        if n <= mask_max:
            yield "whole mask (before)", lambda q, k, v, s: whole_mask(q, k, v, s, window)
    else:
        yield "SDPA fused (ours)", lambda q, k, v, s: attend(q, k, v, s)
        if n <= math_max:
            yield "SDPA math", lambda q, k, v, s: sdpa(q, k, v, s, 0, "math")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--mask-max", type=int, default=16384, help="longest prompt for the whole-mask arm ([L, L] mask)")
    ap.add_argument("--math-max", type=int, default=8192, help="longest prompt for the math arm ([H, L, L] scores)")
    ap.add_argument("--roofline", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    peaks = None
    if args.roofline:
        from ridgefill_runtime.eval.roofline import measure_peaks

        peaks = measure_peaks(args.threads)
    print(
        f"threads={args.threads} torch={torch.__version__} reps={args.reps} float32"
        + (f" peaks: {peaks.describe()}" if peaks else "")
    )
    print("| layer | tokens | arm | median s | GFLOP/s | of FMA peak | max err vs float64 | vs ours |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        heads, kv_heads, dim, window = SHAPES[shape]
        scale = dim**-0.5
        for n in args.lengths:
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
            rows = torch.linspace(0, n - 1, 24).long()
            want = reference_rows(q, k, v, scale, window, rows)
            flops = attention_flops(n, heads, dim, window)
            results = []
            for name, fn in arms(window, n, args.mask_max, args.math_max):
                err = (fn(q, k, v, scale)[rows].double() - want).abs().max().item()
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    fn(q, k, v, scale)
                    times.append(time.perf_counter() - t0)
                results.append((name, statistics.median(times), err))
            ours = results[0][1]
            for name, s, err in results:
                gf = flops / s / 1e9
                frac = f"{gf / peaks.fma_gflops:.2f}" if peaks else "-"
                print(
                    f"| {shape} | {n} | {name} | {s:.3f} | {gf:.1f} | {frac} | {err:.1e} | {s / ours:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
