"""What a narrower K/V cache (cache.kv_dtype) costs in accuracy, on the embedded SmolLM2 (Q4_1 GGUF):
float16 and bfloat16 slabs against the float32 cache, same packed weights, float32 compute.

    python benchmarks/kv_dtype_agreement.py --threads 2 --docs 2 --tokens 1024 --chunk 128 --new 256

(a) teacher-forced: each real-text document is scored (log p(next token) at every position) in
    prompt chunks of `--chunk` rows, so every chunk after the first reads the earlier rows' K/V from
    the cache, rounded to its dtype (a one-chunk prefill attends to the keys it just made and would
    not show it). Reported: max and mean |Δ log p| against the float32 cache, argmax agreement.
(b) free-running greedy: `--new` tokens from the first 256 tokens of each document; the first
    position where the tokens differ from the float32 cache's.
K/V bytes per token come from the pool itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's real-text helper
from prefill import real_text_ids  # noqa: E402

KV_DTYPES = ("auto", "float16", "bfloat16")


def build(kv_dtype: str, docs: int, positions: int, chunk: int):
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.llm import LLM

    blocks = docs * (-(-(positions + 1) // 16) + 1)
    return LLM(
        EngineConfig(
            weights="packed",
            dtype="float32",
            cache=CacheConfig(block_size=16, num_blocks=blocks, kv_dtype=kv_dtype),
            scheduler=SchedulerConfig(max_num_seqs=docs, max_num_batched_tokens=chunk + docs, chunk_size=chunk),
        )
    )


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per scored document")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--new", type=int, default=256, help="greedy tokens per document in (b)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from ridgefill_runtime.sequence import SamplingParams

    llms = {kv: build(kv, args.docs, max(args.tokens, 256 + args.new), args.chunk) for kv in KV_DTYPES}
    ids = real_text_ids(llms["auto"].tokenizer, args.docs * args.tokens)
    docs = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.docs)]
    print(
        f"threads={torch.get_num_threads()} SmolLM2-135M Q4_1 packed, float32 compute; {args.docs} documents x "
        f"{args.tokens} tokens scored in chunks of {args.chunk}; {args.new} greedy tokens each\n"
    )
    scores = {kv: [llm.score(d) for d in docs] for kv, llm in llms.items()}
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    greedy = {kv: [c.token_ids for c in llm.generate([d[:256] for d in docs], params)] for kv, llm in llms.items()}
    print(
        "| K/V cache | bytes per token | max abs Δ log p | mean abs Δ log p | argmax agree | "
        "greedy: first divergence per document |"
    )
    print("|---|---|---|---|---|---|")
    for kv, llm in llms.items():
        d, agree, total = [], 0, 0
        for mine, ref in zip(scores[kv], scores["auto"]):
            d += [abs(x - y) for x, y in zip(mine["target_logprobs"], ref["target_logprobs"])]
            agree += sum(x == y for x, y in zip(mine["argmax"], ref["argmax"]))
            total += len(ref["argmax"])
        div = ", ".join(
            "none" if (i := first_divergence(a, b)) is None else str(i) for a, b in zip(greedy[kv], greedy["auto"])
        )
        name = "float32 (auto)" if kv == "auto" else kv
        print(
            f"| {name} | {llm.engine.kv.bytes_per_token():,} | {max(d):.3g} | {statistics.fmean(d):.3g} | "
            f"{agree} / {total} | {div} |"
        )


if __name__ == "__main__":
    main()
