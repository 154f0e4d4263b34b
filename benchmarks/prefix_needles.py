"""Issue 32's check: 8 needle prompts that share one ~4K-token Perl-documentation haystack, a
different key-value needle at a different depth inside the filled prefix of each, the question at
the end; each prompt asked filled (fill plain, the shipped SmolLM2 maps and selectors) and exact,
alternating which goes first, one after another, on an engine with the prefix cache on (reuse_filled
as given, "reselect" by default) and on one with it off. Prints answers right out of 8 per arm and
the largest |Δ log-prob| of a filled answer's tokens between the two engines.

  .venv/bin/python benchmarks/prefix_needles.py --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time
from pathlib import Path

import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.fill.settings import fill_for_arm
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.sequence import SamplingParams

HAYSTACK = Path("/usr/share/perl/5.36.0/pod/perldiag.pod")  # Debian's perl-modules package
KEYS = ("amber-falcon", "quiet-harbor", "silver-orchard", "copper-meadow", "hollow-ember", "violet-canyon")
KEYS += ("rusty-lantern", "frozen-tide")


def prompts(tok, length: int, tail: int, seed: int) -> list[tuple[list[int], str]]:
    """(ids, value): the needles sit at 8 depths spread over the filled prefix."""
    head = tok.apply_chat_template([{"role": "user", "content": "@@"}], add_generation_prompt=True)
    pre, post = head.split("@@")
    pre_ids = tok.encode(pre + "Read the text and answer the question.\n\n")
    hay = tok.encode(HAYSTACK.read_text(errors="replace"), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for i, key in enumerate(KEYS):
        value = str(rng.randint(1_000_000, 9_999_999))
        needle = tok.encode(f"\nThe special magic number for {key} is {value}.\n")
        question = tok.encode(
            f"\n\nWhat is the special magic number for {key} mentioned in the text above? "
            "Answer with the numbers only." + post
        )
        body = length - len(pre_ids) - len(needle) - len(question)
        # NOTE: 8 depths spread over the filled prefix, in a shuffled order (the cache sees shallow and deep)
        depth = [7, 2, 5, 0, 3, 6, 1, 4][i] * (length - tail - len(pre_ids) - 96) // len(KEYS) + 32
        out.append((pre_ids + hay[:depth] + needle + hay[depth:body] + question, value))
    return out


def ask(llm: LLM, ids: list[int], fill: bool, max_tokens: int):
    eng = llm.engine
    seq = eng.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0), fill=fill)
    while eng.has_unfinished():
        eng.step()
    return seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--reuse-filled", default="reselect")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fill = dataclasses.replace(fill_for_arm("ridgefill", None), tail=args.tail, reuse_filled=args.reuse_filled)
    engines = {
        arm: LLM(EngineConfig(cache=CacheConfig(kv_cache_gib=1.0, prefix_caching=arm), fill=fill))
        for arm in ("on", "off")
    }
    tok = engines["on"].tokenizer
    right = {(arm, kind): 0 for arm in engines for kind in ("filled", "exact")}
    worst = 0.0
    start = time.perf_counter()
    for i, (ids, value) in enumerate(prompts(tok, args.length, args.tail, args.seed)):
        order = (True, False) if i % 2 == 0 else (False, True)
        got = {}
        for arm, llm in engines.items():
            for fill_on in order:
                seq = ask(llm, ids, fill_on, args.max_tokens)
                kind = "filled" if fill_on else "exact"
                text = tok.decode(seq.output_ids)
                right[arm, kind] += value in text
                got[arm, kind] = seq
                print(
                    f"prompt {i} ({len(ids)} tokens) cache {arm:3} {kind:6}: cached {seq.prefix.num_cached:4}, "
                    f"exact rows {len(seq.fill.exact_rows):3}, {'right' if value in text else 'wrong'}: {text!r}",
                    flush=True,
                )
        a, b = got["on", "filled"], got["off", "filled"]
        n = next((k for k, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), len(a.output_ids))
        if n:  # NOTE: the log-probs of the tokens both chose, up to the first that differs (if any)
            diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs.output[:n], b.logprobs.output[:n])]
            worst = max(worst, max(diffs))
    print(
        f"\n{len(KEYS)} prompts of {args.length} tokens, tail {args.tail}, reuse_filled {args.reuse_filled}, "
        f"threads {args.threads}, {time.perf_counter() - start:.0f} s"
    )
    for (arm, kind), n in right.items():
        print(f"cache {arm:3} {kind:6}: {n} of {len(KEYS)} right")
    print(f"filled answers, cache on vs off: max |Δ logprob| {worst:.2e} over the tokens both chose")


if __name__ == "__main__":
    main()
