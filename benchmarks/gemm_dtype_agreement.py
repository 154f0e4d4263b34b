"""What bfloat16 GEMMs (model.gemm_dtype) cost in accuracy against float32, on a packaged model or the
embedded SmolLM2: same packed weights, same float32 K/V; only calls of 16 rows and up multiply in
bfloat16 (128 and up: a BLAS GEMM, outputs rounded to bfloat16; 16 to 127: the packed kernel's whole
16-row blocks, float32 sums, the path of decode batches), batch-1 decode stays float32. `--chunk 64`
scores every row through that decode-batch path.

    python benchmarks/gemm_dtype_agreement.py --threads 2 --model gemma3-270m --docs 4 --tokens 2048

(a) teacher-forced: each real-text document is scored (log p(next token) at every position) in
    prompt chunks of `--chunk` rows, every row through the GEMM path. Reported: mean NLL per token
    (nats) of each arm, max and mean |Δ log p| against float32, argmax agreement.
(b) free-running greedy: `--new` tokens after the first `--prompt` tokens of each document (the
    prompt prefilled in bfloat16, the decode in float32); the first position where the tokens
    differ from float32's.
(c) with --llama-cpp, the same for llama.cpp (llama-cpp-python, same GGUF, its own quantized-activation
    kernels, n_batch 512): how far the peer itself lies from float32, for scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's real-text helper
from agreement import agreement  # noqa: E402
from prefill import real_text_ids  # noqa: E402

ARMS = ("float32", "bfloat16")


def build(gemm_dtype: str, positions: int, chunk: int, model: str | None):
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.llm import LLM

    return LLM(
        EngineConfig(
            model=model,
            weights="packed",
            gemm_dtype=gemm_dtype,
            cache=CacheConfig(block_size=16, num_blocks=-(-(positions + 1) // 16) + 2, prefix_caching="off"),
            scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk, chunk_size=chunk),
        )
    )


def llama_cpp_arm(model: str | None, docs: list[list[int]], prompts: list[list[int]], new: int, threads: int):
    """llama.cpp's teacher-forced scores ({target_logprobs, argmax} per document) and greedy tokens."""
    import llama_cpp
    import numpy as np

    from ridgefill_runtime.loader.gguf import default_model_path
    from ridgefill_runtime.loader.packaged import packaged_model_path

    path = packaged_model_path(model) if model else default_model_path()
    n_ctx = max(max(map(len, docs)), max(map(len, prompts)) + new) + 16
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
        logits_all=True, verbose=False,
    )  # fmt: skip
    scores = []
    for doc in docs:
        llm.reset()
        llm.eval(doc)
        logits = torch.from_numpy(np.asarray(llm.scores[: len(doc) - 1], dtype=np.float32))  # [n - 1, V]
        logp = torch.log_softmax(logits.double(), dim=-1)
        targets = torch.tensor(doc[1:])
        scores.append(
            {
                "target_logprobs": logp.gather(1, targets[:, None])[:, 0].tolist(),
                "argmax": logits.argmax(-1).tolist(),
            }
        )
    greedy = []
    for prompt in prompts:
        llm.reset()
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == new:
                break
        greedy.append(out)
    return scores, greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a packaged model's name (default: the embedded SmolLM2)")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per scored document")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens before the greedy tokens of (b)")
    ap.add_argument("--new", type=int, default=128, help="greedy tokens per document in (b)")
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True, help="the llama.cpp row (c)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from ridgefill_runtime.sequence import SamplingParams

    positions = max(args.tokens, args.prompt + args.new)
    llms = {g: build(g, positions, args.chunk, args.model) for g in ARMS}
    ids = real_text_ids(llms["float32"].tokenizer, args.docs * args.tokens)
    docs = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.docs)]
    print(
        f"threads={torch.get_num_threads()} {args.model or 'SmolLM2-135M Q4_1'} packed, float32 K/V; "
        f"{args.docs} documents x {args.tokens} tokens scored in chunks of {args.chunk}; {args.new} greedy "
        f"tokens after {args.prompt} prompt tokens each; load before: "
        f"{' '.join(open('/proc/loadavg').read().split()[:3])}\n"
    )
    scores = {g: [llm.score(d) for d in docs] for g, llm in llms.items()}
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    prompts = [d[: args.prompt] for d in docs]
    greedy = {g: [c.token_ids for c in llm.generate(prompts, params)] for g, llm in llms.items()}
    arms = list(ARMS)
    if args.llama_cpp:
        scores["llama.cpp"], greedy["llama.cpp"] = llama_cpp_arm(args.model, docs, prompts, args.new, args.threads)
        arms.append("llama.cpp")
    print(
        "| arm | mean NLL (nats/token) | max abs Δ log p | mean abs Δ log p | argmax agree | "
        "greedy: first divergence per document |"
    )
    print("|---|---|---|---|---|---|")
    for g in arms:
        a = agreement(scores[g], scores["float32"], greedy[g], greedy["float32"])
        name = g if g == "llama.cpp" else f"ours, gemm_dtype {g}"
        print(
            f"| {name} | {a.nll:.4f} | {a.max_dlogp:.3g} | {a.mean_dlogp:.3g} | {a.argmax_agree} / {a.positions} "
            f"| {a.divergences} |"
        )


if __name__ == "__main__":
    main()
