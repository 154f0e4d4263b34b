"""Batch-1 decode: how much of a step is spent outside the weight and attention kernels.

At batch 1 a small model's step is the weight sweep (packed_linear), the attention kernel, and the
glue around them: norms, RoPE, K/V writes, slicing, sampling, the scheduler and Python. llama.cpp's
glue is a few C loops; ours is tensor ops and Python, so it is measured here on its own: the same
engine steps are timed as they are, then with packed_linear's kernel and then the attention kernel
replaced by an empty output of the right shape (the logits are then garbage; greedy picks one anyway).
What is left is the glue. Step times are p50 and min of --steps steps after --warmup.

    python benchmarks/decode_overhead.py --threads 2 --model gemma3-270m --context 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import real_text_prompts, ridgefill_engine  # noqa: E402


def step_times(engine, warmup: int, steps: int) -> tuple[float, float]:
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3, times[0] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import ridgefill_runtime.layers.attention as attention
    import ridgefill_runtime.ops.packed_linear as packed
    from ridgefill_runtime.config import CacheConfig, EngineConfig
    from ridgefill_runtime.llm import LLM
    from ridgefill_runtime.sequence import SamplingParams

    llm = LLM(EngineConfig(model=args.model, dtype="float32", weights="packed", cache=CacheConfig(kv_cache_gib=0.05)))
    prompt = real_text_prompts(llm.tokenizer, 1, args.context)[0]
    budget = 3 * (args.warmup + args.steps) + 8
    engine = ridgefill_engine(llm, "packed", "float32", 1, budget, args.context, 512)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))
    while not seq.output_ids:
        engine.step()

    rows = [("as it runs", *step_times(engine, args.warmup, args.steps))]
    packed._KERNEL = lambda x, data, scale, mn, bits, group, n: torch.empty(x.shape[0], n)  # noqa: ARG005
    rows.append(("packed_linear kernel stubbed", *step_times(engine, args.warmup, args.steps)))
    attention.scattered_rows_attention = lambda q, *a, **kw: (torch.empty_like(q), None)  # noqa: ARG005
    rows.append(("and the attention kernel too: the glue", *step_times(engine, args.warmup, args.steps)))

    print(f"threads={args.threads} model={args.model} context={args.context} B=1 torch={torch.__version__}")
    print("| step | p50 ms | min ms |\n|---|---|---|")
    for name, p50, low in rows:
        print(f"| {name} | {p50:.2f} | {low:.2f} |")
    whole, glue = rows[0][1], rows[2][1]
    print(f"glue / step (p50): {glue / whole:.2f}")


if __name__ == "__main__":
    main()
