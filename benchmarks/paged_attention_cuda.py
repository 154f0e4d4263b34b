"""Batched paged decode attention on CUDA: the compiled ridgefill::scattered_rows_attention kernel
(csrc/scattered_rows_attention.cu) with split-KV forced off against its heuristic (split long rows' keys into
chunks when the launch has too few blocks, then combine the chunks).

    python benchmarks/paged_attention_cuda.py                       # bfloat16, both shapes, B 1/4/16/64, 1K/4K/16K
    python benchmarks/paged_attention_cuda.py --dtype float16 --contexts 32768 --out split.json

B decode rows (one per sequence, each at the end of its own context of C keys) in one call, the sequences'
blocks shuffled over one KV slab as in the runtime's pool. Shapes: "smollm2" (9 heads / 3 KV heads / D 64) and
"large" (32 heads / 8 KV heads / D 128). The kernel reads RIDGEFILL_CUDA_ATTN_SPLIT once per process, so each
mode runs in a child process of this script (--worker). Each call is timed with CUDA events around a CUDA graph
of --calls back-to-back calls (no Python or launch overhead; the op is graph-capturable), median of --reps
replays. "GB/s" is the K/V bytes the call must read (B x C x Hkv x D x 2 x itemsize) over that time; the
smallest cases fit in L2 (50 MB on an H100/H200) and can read faster than HBM. Outputs are checked against the
torch reference once per case (a sanity check; timings never assert).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHAPES = {"smollm2": (9, 3, 64), "large": (32, 8, 128)}  # (H, Hkv, D)
MODES = {"off": "0", "heuristic": None}  # RIDGEFILL_CUDA_ATTN_SPLIT per column (None: unset)


def make_batch(batch, context, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """B sequences of `context` keys in shuffled blocks, one decode row each (at position context - 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_blocks = -(-context // block_size)
    num_blocks = batch * max_blocks + 8
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    tables = perm[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    k_slab = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v_slab = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    q_pos = torch.full((batch,), context - 1, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, heads, head_dim, generator=gen, device="cuda").to(dtype)
    return q, q_seq, q_pos, k_slab, v_slab, tables, ctx


def time_graph(fn, calls: int, reps: int) -> float:
    """Median seconds per call: a CUDA graph of `calls` back-to-back calls, timed with events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def worker(args) -> list[dict]:
    """All cases in this process, in the split mode its environment sets."""
    from ridgefill_runtime import ops
    from ridgefill_runtime.ops import scattered_rows_attention_reference

    if not ops.extension_loaded():
        raise SystemExit(f"ridgefill_runtime._C is not loaded ({ops.extension_error()}): build the extension first")
    kernel = torch.ops.ridgefill.scattered_rows_attention
    dtype = DTYPES[args.dtype]
    results = []
    for shape in args.shapes:
        heads, kv_heads, head_dim = SHAPES[shape]
        scale = head_dim**-0.5
        for context in args.contexts:
            for batch in args.batches:
                inputs = make_batch(batch, context, heads, kv_heads, head_dim, args.block_size, dtype)
                call = (*inputs, args.block_size, scale, False)
                out = kernel(*call)[0]
                expected = scattered_rows_attention_reference(*call)[0]
                err = (out.float() - expected.float()).abs().max().item()
                assert err < (1e-4 if dtype == torch.float32 else 3e-2), (shape, batch, context, err)  # sanity
                seconds = time_graph(lambda: kernel(*call), args.calls, args.reps)  # noqa: F821 - timed before the del below
                kv_bytes = batch * context * kv_heads * head_dim * 2 * inputs[3].element_size()
                results.append(
                    {
                        "shape": shape,
                        "heads": heads,
                        "kv_heads": kv_heads,
                        "head_dim": head_dim,
                        "batch": batch,
                        "context": context,
                        "ms": seconds * 1e3,
                        "gb_per_s": kv_bytes / seconds / 1e9,
                        "max_abs_err": err,
                    }
                )
                del inputs, call, out, expected
                torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--shapes", choices=list(SHAPES), nargs="+", default=list(SHAPES))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    parser.add_argument("--calls", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--reps", type=int, default=10, help="timed graph replays (the median is reported)")
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        raise SystemExit(
            "paged_attention_cuda.py needs a CUDA device (torch.cuda.is_available() is False); "
            "benchmarks/paged_attention_cpu.py times the CPU kernel"
        )
    if args.worker:
        print("RESULTS " + json.dumps(worker(args)))
        return

    # One child per split mode: the kernel reads RIDGEFILL_CUDA_ATTN_SPLIT once per process.
    runs = {}
    for mode, knob in MODES.items():
        env = dict(os.environ)
        env.pop("RIDGEFILL_CUDA_ATTN_SPLIT", None)
        if knob is not None:
            env["RIDGEFILL_CUDA_ATTN_SPLIT"] = knob
        res = subprocess.run(
            [sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, capture_output=True, text=True
        )
        lines = [line for line in res.stdout.splitlines() if line.startswith("RESULTS ")]
        if res.returncode != 0 or not lines:
            raise SystemExit(f"split mode {mode}: worker failed (rc {res.returncode})\n{res.stdout}\n{res.stderr}")
        runs[mode] = json.loads(lines[-1][len("RESULTS ") :])

    props = torch.cuda.get_device_properties(0)
    print(
        f"{props.name} ({props.multi_processor_count} SMs), {args.dtype}, block size {args.block_size}, "
        f"graph of {args.calls} calls, median of {args.reps}"
    )
    print(
        f"{'shape':>8} {'B':>4} {'context':>8} {'off ms':>9} {'off GB/s':>9} {'split ms':>9} {'split GB/s':>10} "
        f"{'speed-up':>9}"
    )
    rows = []
    for off, split in zip(runs["off"], runs["heuristic"]):
        speedup = off["ms"] / split["ms"]
        print(
            f"{off['shape']:>8} {off['batch']:>4} {off['context']:>8} {off['ms']:>9.4f} {off['gb_per_s']:>9.1f} "
            f"{split['ms']:>9.4f} {split['gb_per_s']:>10.1f} {speedup:>8.2f}x"
        )
        rows.append(
            {
                **{k: off[k] for k in ("shape", "heads", "kv_heads", "head_dim", "batch", "context")},
                "off_ms": off["ms"],
                "off_gb_per_s": off["gb_per_s"],
                "split_ms": split["ms"],
                "split_gb_per_s": split["gb_per_s"],
                "speedup": speedup,
            }
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": props.name,
                    "sms": props.multi_processor_count,
                    "dtype": args.dtype,
                    "block_size": args.block_size,
                    "calls": args.calls,
                    "reps": args.reps,
                    "results": rows,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
