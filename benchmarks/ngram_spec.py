"""N-gram (prompt-lookup) speculative decoding on the embedded model (float32, CPU): greedy
tokens/s with and without speculation, measured in one run on two workloads, "copy" (repeat a
code snippet with a small edit: drafts come from the prompt) and "chat" (plain questions).

Each request runs alone (batch 1, the latency case speculation is for), first without, then
with speculation, on one engine (a request's `speculative = 0` turns it off); outputs are
checked token for token equal.

    .venv/bin/python benchmarks/ngram_spec.py --threads 2 [--max-tokens 96] [--num-tokens 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ridgefill_runtime.config import EngineConfig, SpeculativeConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams

CODE = [
    "def add(a, b):\n    total = a + b\n    return total\n\n\nprint(add(2, 3))\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n",
    "def factorial(n):\n    if n == 0:\n        return 1\n    return n * factorial(n - 1)\n\n\n"
    "for i in range(5):\n    print(i, factorial(i))\n",
    "numbers = [1, 2, 3, 4, 5]\nsquares = [n * n for n in numbers]\nevens = [n for n in numbers if n % 2 == 0]\n"
    "print(squares, evens)\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
    "    return [line.strip() for line in lines]\n",
    "def maximum(values):\n    best = values[0]\n    for v in values:\n        if v > best:\n            best = v\n"
    "    return best\n",
]
EDITS = ["rename the function to something clearer", "change the numbers", "add a short comment at the top"]
CHAT = [
    "What is the capital of France? Answer in two sentences.",
    "Give me three tips for sleeping well.",
    "Explain what a rainbow is to a child.",
    "Write a short poem about autumn.",
    "What are the benefits of drinking water?",
    "Describe a cat in a few sentences.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False)


def run_one(engine, prompt: list[int], params: SamplingParams):
    seq = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return seq.output_ids


def measure(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    s0, t0 = engine.stats(), time.perf_counter()
    outputs = [run_one(engine, p, params) for p in prompts]
    seconds, s1 = time.perf_counter() - t0, engine.stats()
    tokens = sum(len(o) for o in outputs)
    steps = s1.spec_steps_total - s0.spec_steps_total
    accepted = s1.spec_accepted_tokens_total - s0.spec_accepted_tokens_total
    proposed = s1.spec_draft_tokens_total - s0.spec_draft_tokens_total
    return dict(
        outputs=outputs,
        tokens=tokens,
        seconds=seconds,
        tps=tokens / seconds,
        steps=steps,
        accepted=accepted,
        proposed=proposed,
        engine_steps=s1.steps_total - s0.steps_total,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-tokens", type=int, default=4, help="speculative.num_tokens")
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--min-ngram", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = SpeculativeConfig(
        method="ngram", num_tokens=args.num_tokens, max_ngram=args.max_ngram, min_ngram=args.min_ngram
    )
    engine = build_engine(EngineConfig(speculative=spec))
    tok = engine.tokenizer
    workloads = {
        "copy": [
            chat_ids(tok, f"Repeat this code, but {EDITS[i % len(EDITS)]}:\n\n```python\n{c}```")
            for i, c in enumerate(CODE)
        ],
        "chat": [chat_ids(tok, c) for c in CHAT],
    }
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    run_one(engine, workloads["chat"][0], dataclasses.replace(greedy, max_tokens=4))  # warm-up
    print(f"model: embedded SmolLM2-135M-Instruct, float32, CPU, torch threads: {torch.get_num_threads()}")
    print(f"speculative: {spec}; greedy, max_tokens {args.max_tokens}, one request at a time")
    print()
    print(
        "| workload | prompts | tokens | plain tok/s | spec tok/s | speedup | verify steps | "
        "drafts/step | accepted/step | acceptance | identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, prompts in workloads.items():
        plain = measure(engine, prompts, dataclasses.replace(greedy, speculative=0))
        fast = measure(engine, prompts, greedy)
        same = plain["outputs"] == fast["outputs"]
        steps = max(fast["steps"], 1)
        print(
            f"| {name} | {len(prompts)} | {fast['tokens']} | {plain['tps']:.1f} | {fast['tps']:.1f} | "
            f"{fast['tps'] / plain['tps']:.2f}x | {fast['steps']} | {fast['proposed'] / steps:.2f} | "
            f"{fast['accepted'] / steps:.2f} | {fast['accepted'] / max(fast['proposed'], 1):.0%} | {same} |"
        )
    print()
    print(
        "tok/s: generated tokens / wall time (prefill included); verify steps: decode steps that "
        "verified a draft; accepted/step: accepted draft tokens per verify step (each also yields "
        "the model's own next token)."
    )


if __name__ == "__main__":
    main()
