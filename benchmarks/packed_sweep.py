"""The packed-weight kernel as decode meets it: every linear weight of SmolLM2-135M's 30 layers
(Q4_1 shapes: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and its Q8_0 head
(49152x576) multiplied once each, in layer order, per "step", so the 96 MB of weights stream from
memory as in a decode step (the L2 holds none of it between steps). Random weights of the real
formats; the op is ridgefill::packed_linear as installed.

    python benchmarks/packed_sweep.py --threads 2
    python benchmarks/packed_sweep.py --device cuda --rows 1 4 8 16 32 64

Prints, per row count M, the median step time of --reps steps, the weight bytes it read per second,
and the layers' and the head's share. Timings never assert; the outputs are checked against the
float64 reference once, on one layer. --device cuda times the CUDA kernel (csrc/packed_linear.cu;
from CUDA_BLAS_MIN_ROWS rows the packed_dequantize_t + cuBLAS route) with CUDA events around each
step. The 96 MB of weights exceed an H100/H200's 50 MB L2, so steps still read them from DRAM; the
step is launched eagerly (121 launches), so where the host launches slower than the GPU runs,
the time includes that gap (a decode step in a CUDA graph would not).
"""

from __future__ import annotations

import argparse
import statistics
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: cuda_kernels.py's CUDA-event timer
from cuda_kernels import timed as cuda_timed  # noqa: E402
from ridgefill_runtime.ops.packed_linear import compiled_for, pack, packed_linear, packed_linear_reference

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (n, K) of qkv, o, gate_up, down
HEAD = (49152, 576)


def random_packed(n: int, k: int, bits: int, with_min: bool, gen: torch.Generator):
    q = torch.randint(0, 16, (n, k), generator=gen) if bits == 4 else torch.randint(-128, 128, (n, k), generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    mins = (torch.randn(n, k // 32, generator=gen) * 0.05).half() if with_min else None
    return pack(q, scale, mins, bits, 32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("packed_sweep.py --device cuda: no CUDA device (torch.cuda.is_available() is False)")
    if device.type == "cuda" and not compiled_for(device):
        raise SystemExit("no CUDA kernel for packed_linear in this build (or no GPU): nothing to measure")
    gen = torch.Generator().manual_seed(0)
    layers = [[random_packed(n, k, 4, True, gen) for n, k in LAYER_SHAPES] for _ in range(args.layers)]
    head = random_packed(*HEAD, 8, False, gen)
    total = sum(w.nbytes() for layer in layers for w in layer) + head.nbytes()

    w = layers[0][2]
    x = torch.randn(3, w.shape[1], generator=gen)
    y = packed_linear(x.to(device), w.to(device)).cpu()
    err = (y.double() - packed_linear_reference(x, w)).abs().max().item()
    if device.type == "cuda":
        layers = [[wt.to(device) for wt in layer] for layer in layers]
        head = head.to(device)
        where = torch.cuda.get_device_name(device)
    else:
        where = f"threads={torch.get_num_threads()}"
    print(f"{where} weights={total / 1e6:.1f} MB; check on one layer: max |err| {err:.2e}")
    print("| M | step ms | GB/s of weights | layers ms | head ms |")
    print("|---|---|---|---|---|")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen).to(device) for k in (576, 1536)}

        def run_layers() -> None:
            for layer in layers:
                for wt in layer:
                    packed_linear(xs[wt.shape[1]], wt)

        def timed(fn) -> float:
            if device.type == "cuda":  # device time of the step's kernels (launches queue ahead)
                return cuda_timed(fn, args.reps)
            for _ in range(3):
                fn()
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        step = timed(lambda: (run_layers(), packed_linear(xs[576], head)))
        only = timed(run_layers)
        print(f"| {m} | {step * 1e3:.2f} | {total / step / 1e9:.1f} | {only * 1e3:.2f} | {(step - only) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
