"""Packed weights equal the dequantized path to float32 rounding, on the embedded SmolLM2 (Q4_1 GGUF).

    python benchmarks/packed_agreement.py --threads 2 --prompts 2 --prompt-tokens 256 --tokens 1000 \
        --out packed_agreement.json

Two engines on the same file, float32: weights = "packed" (the GGUF's quantized blocks, multiplied
by the weight-only kernel) and weights = "dequantized" (the blocks expanded to float32 once, then
ordinary matmuls). Both see the same weights; only the order of the float32 arithmetic differs.

(a) free-running greedy: each engine generates `--tokens` tokens (ignore_eos) from each of
    `--prompts` distinct real-text prompts of `--prompt-tokens` tokens (the prompts run as one
    batch in both engines). Reported per prompt: the first position where the greedy tokens
    differ (none: identical) and the positions that agree. After a divergence the two
    continuations are different texts, so the count past it says little; the first
    divergence index is the figure.
(b) teacher-forced: prompt + the dequantized path's generated tokens are scored by both engines
    (SamplingParams(max_tokens=0, prompt_logprobs=True), LLM.score): log p(next token) at every
    position. Reported: max and mean |Δ logprob| over all scored positions, and how often the two
    engines' argmax agree there.

Prompt rows run `--chunk` per step in both (a) and (b); every packed call, whatever its rows,
runs the packed kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's real-text helper
from prefill import real_text_ids  # noqa: E402


def build(weights: str, prompts: int, positions: int, chunk: int):
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.llm import LLM

    blocks = prompts * (-(-(positions + 1) // 16) + 1)
    return LLM(
        EngineConfig(
            weights=weights,
            dtype="float32",
            cache=CacheConfig(block_size=16, num_blocks=blocks),
            scheduler=SchedulerConfig(max_num_seqs=prompts, max_num_batched_tokens=chunk + prompts, chunk_size=chunk),
        )
    )


def generate(llm, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    from ridgefill_runtime.sequence import SamplingParams

    t = time.perf_counter()
    out = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    return [c.token_ids for c in out], time.perf_counter() - t


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=1000, help="greedy tokens generated per prompt")
    ap.add_argument("--chunk", type=int, default=256, help="prompt rows per step (prefill and scoring)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from ridgefill_runtime.loader.gguf import default_model_path

    positions = args.prompt_tokens + args.tokens
    packed = build("packed", args.prompts, positions, args.chunk)
    dense = build("dequantized", args.prompts, positions, args.chunk)
    ids = real_text_ids(dense.tokenizer, args.prompts * args.prompt_tokens)
    prompts = [ids[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} model={default_model_path().name} "
        f"float32; {args.prompts} prompts x {args.prompt_tokens} tokens, {args.tokens} greedy tokens each"
    )

    gen_p, secs_p = generate(packed, prompts, args.tokens)
    gen_d, secs_d = generate(dense, prompts, args.tokens)
    free = []
    for i, (a, b) in enumerate(zip(gen_p, gen_d)):
        free.append(
            {
                "prompt": i,
                "tokens": len(b),
                "first_divergence": first_divergence(a, b),
                "agree": sum(x == y for x, y in zip(a, b)),
            }
        )

    forced = []
    all_d: list[float] = []
    for i, (p, g) in enumerate(zip(prompts, gen_d)):
        sp, sd = packed.score(p + g), dense.score(p + g)
        lp, ld = sp["target_logprobs"], sd["target_logprobs"]
        if len(lp) != len(ld) or len(ld) != len(p) + len(g) - 1:
            raise RuntimeError(f"prompt {i}: scored {len(lp)} / {len(ld)} positions, expected {len(p) + len(g) - 1}")
        d = [abs(x - y) for x, y in zip(lp, ld)]
        all_d += d
        agree = sum(x == y for x, y in zip(sp["argmax"], sd["argmax"]))
        gen_agree = sum(x == y for x, y in zip(sp["argmax"][len(p) - 1 :], sd["argmax"][len(p) - 1 :]))
        forced.append(
            {
                "prompt": i,
                "positions": len(d),
                "max_abs_dlogprob": max(d),
                "mean_abs_dlogprob": statistics.fmean(d),
                "argmax_agree": agree,
                "generated_positions": len(g),
                "generated_argmax_agree": gen_agree,
            }
        )

    print()
    print("(a) free-running greedy, packed vs dequantized")
    print("| prompt | tokens | first divergence | positions agreeing |")
    print("|---|---|---|---|")
    for r in free:
        div = "none" if r["first_divergence"] is None else str(r["first_divergence"])
        print(f"| {r['prompt']} | {r['tokens']} | {div} | {r['agree']} / {r['tokens']} |")
    total, agree = sum(r["tokens"] for r in free), sum(r["agree"] for r in free)
    print(f"all: {agree} / {total} positions agree; generation took {secs_p:.1f} s packed, {secs_d:.1f} s dequantized")
    print()
    print("(b) teacher-forced on prompt + dequantized tokens")
    print("| prompt | positions | max abs Δ logprob | mean abs Δ logprob | argmax agree | on generated |")
    print("|---|---|---|---|---|---|")
    for r in forced:
        print(
            f"| {r['prompt']} | {r['positions']} | {r['max_abs_dlogprob']:.3g} | {r['mean_abs_dlogprob']:.3g} | "
            f"{r['argmax_agree']} / {r['positions']} | {r['generated_argmax_agree']} / {r['generated_positions']} |"
        )
    summary = {
        "positions": len(all_d),
        "max_abs_dlogprob": max(all_d),
        "mean_abs_dlogprob": statistics.fmean(all_d),
        "argmax_agree": sum(r["argmax_agree"] for r in forced),
    }
    print(
        f"all: {summary['positions']} positions, max |Δ| {summary['max_abs_dlogprob']:.3g}, "
        f"mean |Δ| {summary['mean_abs_dlogprob']:.3g}, "
        f"argmax agree {summary['argmax_agree']} / {summary['positions']}"
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "prompts": args.prompts,
                    "chunk": args.chunk,
                    "prompt_tokens": args.prompt_tokens,
                    "tokens": args.tokens,
                    "free_running": free,
                    "free_running_agree": agree,
                    "free_running_total": total,
                    "teacher_forced": forced,
                    "teacher_forced_all": summary,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
