"""What a narrower K/V cache (cache.kv_dtype) costs in accuracy, on the embedded SmolLM2 (Q4_1 GGUF) or a
packaged model (--model): float16, bfloat16 and int8 (per-row scales, cache/int8_kv.py) slabs against the
float32 cache, same packed weights, float32 compute; and what each does to decode speed.

    python benchmarks/kv_dtype_agreement.py --threads 2 --docs 2 --tokens 1024 --chunk 128 --new 256
    python benchmarks/kv_dtype_agreement.py --threads 2 --model gemma3-270m --batch 16 --rounds 3

(a) teacher-forced: each real-text document is scored (log p(next token) at every position) in
    prompt chunks of `--chunk` rows, so every chunk after the first reads the earlier rows' K/V from
    the cache, rounded to its dtype (a one-chunk prefill attends to the keys it just made and would
    not show it). Reported: max and mean |Δ log p| against the float32 cache, argmax agreement.
(b) free-running greedy: `--new` tokens from the first 256 tokens of each document; the first
    position where the tokens differ from the float32 cache's.
(c) decode speed: ms per decode step at batch 1 and at `--batch` sequences, each after a `--context`-token
    real-text prompt (the median of `--steps` steps, timed once every prefill is over); the dtypes take
    turns, `--rounds` times, and each cell is the median of its rounds.
K/V bytes per token come from the pool itself (int8: its values and its float32 scales).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's real-text helper
from agreement import agreement  # noqa: E402
from prefill import real_text_ids  # noqa: E402

KV_DTYPES = ("auto", "float16", "bfloat16", "int8")


def build(kv_dtype: str, seqs: int, positions: int, chunk: int, model: str | None):
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.llm import LLM

    blocks = seqs * (-(-(positions + 1) // 16) + 1)
    return LLM(
        EngineConfig(
            model=model,
            weights="packed",
            dtype="float32",
            cache=CacheConfig(block_size=16, num_blocks=blocks, kv_dtype=kv_dtype),
            scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=chunk + seqs, chunk_size=chunk),
        )
    )


def decode_ms(llm, prompts: list[list[int]], steps: int) -> float:
    """Median ms of one engine step while `prompts`' sequences all decode (their prefill steps not counted)."""
    from ridgefill_runtime.sequence import SamplingParams

    engine = llm.engine
    # NOTE: a few extra tokens each, so that the sequences admitted first are still decoding at the last step
    params = SamplingParams(max_tokens=steps + 2 * len(prompts) + 1, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while not all(s.output_ids for s in seqs):  # the prefills' steps (the last one samples the first token)
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for s in seqs:
        engine.abort(s)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per scored document")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--new", type=int, default=256, help="greedy tokens per document in (b)")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens before the timed decode steps in (c)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps in (c)")
    ap.add_argument("--batch", type=int, default=16, help="sequences of the batched decode in (c)")
    ap.add_argument("--rounds", type=int, default=3, help="turns of (c) over the dtypes")
    ap.add_argument("--model", default=None, help="a packaged model's name (default: the embedded SmolLM2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from ridgefill_runtime.sequence import SamplingParams

    positions = max(args.tokens, 256 + args.new, args.context + args.steps + 2 * args.batch + 2)
    seqs = max(args.docs, args.batch)
    llms = {kv: build(kv, seqs, positions, args.chunk, args.model) for kv in KV_DTYPES}
    # NOTE: the decode prompts are text past the documents, so they take no prefix-cache hit from them
    ids = real_text_ids(llms["auto"].tokenizer, args.docs * args.tokens + args.batch * args.context)
    docs = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.docs)]
    rest = ids[args.docs * args.tokens :]
    prompts = [rest[i * args.context : (i + 1) * args.context] for i in range(args.batch)]
    model = args.model or "SmolLM2-135M Q4_1"
    print(
        f"threads={torch.get_num_threads()} {model} packed, float32 compute; {args.docs} documents x "
        f"{args.tokens} tokens scored in chunks of {args.chunk}; {args.new} greedy tokens each; decode: median "
        f"of {args.steps} steps after {args.context} prompt tokens each, dtypes in turn, median of {args.rounds} "
        f"rounds; load before: {' '.join(open('/proc/loadavg').read().split()[:3])}\n"
    )
    scores = {kv: [llm.score(d) for d in docs] for kv, llm in llms.items()}
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    greedy = {kv: [c.token_ids for c in llm.generate([d[:256] for d in docs], params)] for kv, llm in llms.items()}
    timed: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for kv, llm in llms.items():
            for b in (1, args.batch):
                timed.setdefault((kv, b), []).append(decode_ms(llm, prompts[:b], args.steps))
    speed = {key: statistics.median(ts) for key, ts in timed.items()}
    print(
        "| K/V cache | bytes per token | max abs Δ log p | mean abs Δ log p | argmax agree | "
        f"greedy: first divergence per document | decode ms/step, batch 1 | decode ms/step, batch {args.batch} |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kv, llm in llms.items():
        a = agreement(scores[kv], scores["auto"], greedy[kv], greedy["auto"])
        name = "float32 (auto)" if kv == "auto" else kv
        print(
            f"| {name} | {llm.engine.kv.bytes_per_token():,} | {a.max_dlogp:.3g} | {a.mean_dlogp:.3g} | "
            f"{a.argmax_agree} / {a.positions} | {a.divergences} | {speed[kv, 1]:.2f} | {speed[kv, args.batch]:.2f} |"
        )


if __name__ == "__main__":
    main()
