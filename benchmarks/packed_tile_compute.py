"""The packed kernel's compute ceiling at few rows: one weight small enough to stay in cache
(4096 x 640, 1.4-2.8 MB), multiplied again and again, so memory does not limit the call and the
time is the kernel's own vector work. Decode at batch 1 reads every weight from DRAM once a step:
where this ceiling sits below the DRAM rate (benchmarks/packed_sweep.py), the kernel, not memory,
sets the step time.

    python benchmarks/packed_tile_compute.py --threads 2 --rows 1 2
    RIDGEFILL_PACKED_ISA=avx2 python benchmarks/packed_tile_compute.py --threads 2   # the AVX2 variant

One line per format (the loader's: Q8_0 (and Q5_0); 8 bits with an fp16 min (a fused projection, and
Q5_0 before CONVERTER_VERSION 3); Q4_K with float32 scales and mins; Q4_1): the minimum of --reps timed calls (the VM's neighbours only ever
slow a call down) and the weight bytes per second that minimum means. Timings never assert; each
output is checked against the float64 reference first.
"""

from __future__ import annotations

import argparse
import time

import torch

from ridgefill_runtime.ops.packed_linear import pack, packed_linear, packed_linear_reference

# name: (bits, scale dtype, with a min, q range); Q5_0 is Q8_0's form with q in -16..15
FORMATS = {
    "Q8_0": (8, torch.float16, False, (-128, 128)),
    "8+min": (8, torch.float16, True, (0, 32)),
    "Q4_K": (4, torch.float32, True, (0, 16)),
    "Q4_1": (4, torch.float16, True, (0, 16)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--shape", type=int, nargs=2, default=[4096, 640], metavar=("N", "K"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    n, k = args.shape
    print(f"threads={args.threads} weight [{n} x {k}] in cache, min of {args.reps} calls")
    for name, (bits, dtype, with_min, (lo, hi)) in FORMATS.items():
        q = torch.randint(lo, hi, (n, k), generator=gen)
        scale = (torch.rand(n, k // 32, generator=gen) * 0.02).to(dtype)
        mins = (torch.randn(n, k // 32, generator=gen) * 0.05).to(dtype) if with_min else None
        w = pack(q, scale, mins, bits, 32)
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            err = (packed_linear(x, w).double() - packed_linear_reference(x, w)).abs().max()
            assert float(err) < 1e-3, f"{name} rows {rows}: max error {float(err)}"
            for _ in range(20):
                packed_linear(x, w)
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                packed_linear(x, w)
                times.append(time.perf_counter() - start)
            best = min(times)
            cells.append(f"rows {rows}: {best * 1e3:.3f} ms ({w.nbytes() / best / 1e9:.1f} GB/s)")
        print(f"{name:5s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
