"""Gemma 3 270M (real GGUF) through ridgefill vs transformers on the same file: target log-probs over
a real text (past the 512-key window, in 512-row chunks) and free-running greedy agreement.

    python benchmarks/gemma3_parity.py --threads 2 [--tokens 1100 --new 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

TEXT = Path("/usr/share/common-licenses/Apache-2.0")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1100)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.llm import LLM
    from ridgefill_runtime.loader.packaged import packaged_model_path
    from ridgefill_runtime.sequence import SamplingParams

    path = packaged_model_path("gemma3-270m")
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ours = LLM(
        EngineConfig(
            model="gemma3-270m",
            cache=CacheConfig(kv_cache_gib=0.2),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, chunk_size=512),
        )
    )
    ids = ours.tokenizer.encode(TEXT.read_text())[: args.tokens]
    got = torch.tensor(ours.score(ids)["target_logprobs"])
    with torch.no_grad():
        logp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    diff = (got - want).abs()
    prompt = ids[:700]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    (gen,) = ours.generate([prompt], SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True))
    agree = next((i for i, (a, b) in enumerate(zip(gen.token_ids, expected)) if a != b), len(expected))
    weights = type(ours.engine.model.weights.layers[0].qkv).__name__
    print(
        f"threads={args.threads} weights={weights} float32 | {len(ids) - 1} scored tokens: "
        f"max |Δ logprob| {diff.max():.2e}, mean {diff.mean():.2e} | greedy: first {agree} of {len(expected)} "
        f"tokens identical after a 700-token prompt"
    )


if __name__ == "__main__":
    main()
