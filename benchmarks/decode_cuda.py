"""Decode speed on a CUDA GPU: ridgefill with and without decode CUDA graphs, packed and
dequantized weights, against transformers on the same GPU, one run.

    python benchmarks/decode_cuda.py --context 1024 --new 64 --batches 1 4 16 64 --out decode_cuda.json

The embedded SmolLM2-135M (Q4_1 GGUF) in bfloat16. Each ridgefill arm (weights x graphs) loads the
model once; each batch size gets a fresh engine over it (decode.py's time_ridgefill: B distinct
real-text prompts prefilled untimed, then `--new` timed engine steps with all B decoding). An
engine step ends in a host read of the sampled tokens, so step times include the GPU's work.

transformers (B = 1): the same prompt through the same GGUF in bfloat16 with its KV cache, then
`--new` single-token forwards, each timed after torch.cuda.synchronize().
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode import real_text_prompts, summary  # noqa: E402


def ridgefill_arm(llm, graphs: bool, dtype: str, weights: str, prompts: list[list[int]], new: int, chunk: int) -> dict:
    """decode.py's timing loop over a fresh engine on the GPU."""
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.engine import Engine
    from ridgefill_runtime.sequence import SamplingParams

    batch, context = len(prompts), len(prompts[0])
    slack = batch * -(-context // chunk) + batch + 2
    max_tokens = new + slack
    block = 16
    blocks = batch * (-(-(context + max_tokens + 1) // block) + 1)
    config = EngineConfig(
        dtype=dtype,
        weights=weights,
        device="cuda",
        cuda_graphs=graphs,
        cache=CacheConfig(block_size=block, num_blocks=blocks),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=chunk + batch, chunk_size=chunk),
    )
    t = time.perf_counter()
    engine = Engine(llm.engine.model, llm.tokenizer, config)
    start_s = time.perf_counter() - t  # graph capture included
    seqs = [
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)) for p in prompts
    ]
    while not all(s.output_ids for s in seqs):
        engine.step()
    steps = []
    for _ in range(new):
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    tokens = list(seqs[0].output_ids[: new + 1]) if batch == 1 else None
    for s in seqs:
        engine.abort(s)
    row = summary(steps, batch)
    row.update(engine_start_s=start_s, graphs=engine.runner.graphs is not None)
    if tokens is not None:
        row["tokens"] = tokens
    return row


@torch.inference_mode()
def hf_arm(model, ids: list[int], new: int) -> dict:
    out = model(torch.tensor([ids], device="cuda"), use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    token = int(out.logits[0, -1].argmax())
    steps, tokens = [], [token]
    for _ in range(new):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(torch.tensor([[token]], device="cuda"), use_cache=True, past_key_values=past)
        past = out.past_key_values
        token = int(out.logits[0, -1].argmax())  # a host read: synchronizes
        steps.append(time.perf_counter() - t)
        tokens.append(token)
    row = summary(steps, 1)
    row["tokens"] = tokens
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--weights", nargs="+", default=["packed", "dequantized"], choices=["packed", "dequantized"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_cuda.py: needs a CUDA device (torch.cuda.is_available() is False)")

    from ridgefill_runtime.config import CacheConfig, EngineConfig
    from ridgefill_runtime.errors import UnsupportedError
    from ridgefill_runtime.llm import LLM
    from ridgefill_runtime.loader.gguf import default_model_path

    path = default_model_path()
    header = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "context": args.context,
        "new": args.new,
        "model": str(path),
    }
    print(" ".join(f"{k}={v}" for k, v in header.items()), flush=True)
    rows, skipped, prompts = [], {}, None
    for weights in args.weights:
        try:
            llm = LLM(
                EngineConfig(
                    dtype=args.dtype,
                    weights=weights,
                    device="cuda",
                    cuda_graphs=False,
                    cache=CacheConfig(kv_cache_gib=0.05),
                )
            )
        except UnsupportedError as e:
            skipped[f"ridgefill {weights}"] = str(e)
            continue
        if prompts is None:
            prompts = real_text_prompts(llm.tokenizer, max(args.batches), args.context)
        ridgefill_arm(llm, True, args.dtype, weights, [prompts[0][:64]], 4, args.chunk)  # warm up
        for graphs in (True, False):
            arm = f"ridgefill {weights}, " + ("graphs" if graphs else "eager")
            for b in args.batches:
                r = ridgefill_arm(llm, graphs, args.dtype, weights, prompts[:b], args.new, args.chunk)
                rows.append({"arm": arm, "batch": b, **r})
                print(
                    f"  {arm} B={b}: ITL {r['itl_p50_ms']:.3f} ms, {r['agg_tok_s']:.0f} tok/s "
                    f"(engine start {r['engine_start_s']:.2f} s)",
                    flush=True,
                )
        del llm
        torch.cuda.empty_cache()
    if args.hf and prompts is not None:
        from transformers import AutoModelForCausalLM

        hf = (
            AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=getattr(torch, args.dtype)
            )
            .to("cuda")
            .eval()
        )
        hf_arm(hf, prompts[0][:64], 4)  # warm up
        r = hf_arm(hf, prompts[0], args.new)
        rows.append({"arm": "transformers", "batch": 1, **r})
        print(f"  transformers B=1: ITL {r['itl_p50_ms']:.3f} ms", flush=True)

    hf_row = next((r for r in rows if r["arm"] == "transformers"), None)
    base = {r["arm"]: r["agg_tok_s"] for r in rows if r["batch"] == 1}
    print("\n| arm | B | ITL p50 ms | ITL p90 ms | agg tok/s | agg vs B=1 | ITL vs transformers |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs_hf = f"{r['itl_p50_ms'] / hf_row['itl_p50_ms']:.2f}x" if hf_row and r["batch"] == 1 else "-"
        print(
            f"| {r['arm']} | {r['batch']} | {r['itl_p50_ms']:.3f} | {r['itl_p90_ms']:.3f} | {r['agg_tok_s']:.0f} | "
            f"{r['agg_tok_s'] / base[r['arm']]:.2f}x | {vs_hf} |"
        )
    b1 = [r for r in rows if r["batch"] == 1 and "tokens" in r]
    agree = len({tuple(r["tokens"]) for r in b1}) == 1
    print(f"\nB=1 greedy tokens agree across arms: {agree}")
    for arm, why in skipped.items():
        print(f"skipped {arm}: {why}")
    graphs_vs_eager = {}
    for weights in args.weights:
        for b in args.batches:
            g = next((r for r in rows if r["arm"] == f"ridgefill {weights}, graphs" and r["batch"] == b), None)
            e = next((r for r in rows if r["arm"] == f"ridgefill {weights}, eager" and r["batch"] == b), None)
            if g and e:
                graphs_vs_eager[f"{weights} B={b}"] = e["itl_p50_ms"] / g["itl_p50_ms"]
    if graphs_vs_eager:
        print("eager / graphs ITL: " + ", ".join(f"{k} {v:.2f}x" for k, v in graphs_vs_eager.items()))
        print(f"median {statistics.median(graphs_vs_eager.values()):.2f}x")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "header": header,
                    "rows": rows,
                    "skipped": skipped,
                    "tokens_agree": agree,
                    "eager_over_graphs": graphs_vs_eager,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
