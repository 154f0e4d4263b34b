"""A second question on a once-filled cache (seed 000, Appendix D) through the prefix cache.

Each sample is a locally generated multikey needle prompt (four keyed needles, the question asks
for one). Turn 1 answers it; turn 2 appends the answer and asks for another key (chosen by the
sample's seed) and runs on what turn 1 left in the cache:

  exact   fill off; turn 2 starts from turn 1's exact blocks (the same as recomputing it)
  fresh   turn 2's whole prompt filled from scratch on an engine without a prefix cache
  never   reuse_filled = "never": turn 1's filled blocks serve only turn 1's prompt, so turn 2 is
          filled again (the same computation as fresh)
  as-is   reuse_filled = "as-is": turn 2 takes turn 1's filled blocks and exact rows unchanged
          (the seed's protocol: rows are not chosen again) and computes only its new rows
  reselect  reuse_filled = "reselect" (the default): turn 2 takes turn 1's blocks, its selectors
          choose rows for the second question, and chosen rows the cache holds filled are remade
          exact (their split states recovered over the cached lower K/V)

An answer counts if the first seven-digit number of the reply is the asked key's (the seed's
rule). Prints accuracy with paired 95% intervals against exact and fresh, the turn-2 TTFT of each
arm (one run, one request at a time), cached tokens and the filled rows among them, and how
much of the second needle the first question's exact rows cover.

  .venv/bin/python benchmarks/prefix_reuse.py --threads 2 --samples 40
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import statistics
import time
from pathlib import Path

import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.eval.measures import paired_bootstrap
from ridgefill_runtime.eval.needles import make_prompt
from ridgefill_runtime.fill.corpus import evaluation_docs
from ridgefill_runtime.fill.settings import fill_for_arm
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.sequence import SamplingParams

MAX_NEW = 32
ARMS = ("exact", "fresh", "never", "as-is", "reselect")
SEVEN = re.compile(r"\d{7}")


def answered(text: str, value: str) -> bool:
    found = SEVEN.search(text)
    return found is not None and found.group(0) == value


def run(llm: LLM, ids: list[int], reuse: str | None = None, fill: bool = True):
    """One request alone on llm's engine: (its sequence, seconds to its first token)."""
    eng = llm.engine
    seq = eng.add_request(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0), fill=fill, reuse_filled=reuse)
    start, ttft = time.perf_counter(), None
    while eng.has_unfinished():
        eng.step()
        if ttft is None and seq.output_ids:
            ttft = time.perf_counter() - start
    return seq, ttft


def second_turn(tok, first_ids: list[int], answer: list[int], key: str) -> list[int]:
    """Turn 1, its answer (without its end-of-turn token) and a new user turn asking for `key`."""
    eos = set(tok.eos_token_ids)
    body = [t for t in answer if t not in eos]
    question = f"What is the special magic number for {key} mentioned in the text above? Answer with the numbers only."
    return first_ids + body + tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def samples(tok, n: int, length: int, tail: int, seed: int):
    """(prompt, second key, its value, its needle's positions) for n multikey prompts."""
    haystacks = [d.text for d in evaluation_docs()[200:]]
    out = []
    for i in range(n):
        rng = random.Random(seed + i)
        p = make_prompt(
            "multikey", tok, " ".join(rng.sample(haystacks, 4)), length, rng, prefix_limit=length - tail - 64
        )
        asked = next(k for k, v, _, _ in p.needles if v in p.answers)
        k2, v2, at, size = rng.choice([x for x in p.needles if x[0] != asked])
        out.append((p, k2, v2, range(at, at + size)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("prefix_reuse.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fill = dataclasses.replace(fill_for_arm("ridgefill", None), tail=args.tail)
    cache = CacheConfig(kv_cache_gib=1.0, prefix_caching="on")
    exact = LLM(EngineConfig(cache=cache))
    filled = LLM(EngineConfig(cache=cache, fill=fill))
    fresh = LLM(EngineConfig(cache=dataclasses.replace(cache, prefix_caching="off"), fill=fill))
    tok = exact.tokenizer
    rows = []
    for i, (prompt, key, value, needle) in enumerate(samples(tok, args.samples, args.length, args.tail, args.seed)):
        first = list(prompt.ids)
        row = {"sample": i, "tokens": len(first), "needle_filled": needle.stop <= len(first) - args.tail}
        e1, _ = run(exact, first, fill=False)
        e2, row["exact:ttft"] = run(exact, second_turn(tok, first, e1.output_ids, key), fill=False)
        row["exact:turn1"] = any(a in tok.decode(e1.output_ids) for a in prompt.answers)
        row["exact"] = answered(tok.decode(e2.output_ids), value)
        f1, _ = run(filled, first, reuse="as-is")
        row["fill:turn1"] = any(a in tok.decode(f1.output_ids) for a in prompt.answers)
        row["covered"] = len(set(needle) & set(f1.fill.exact_rows)) / len(needle)
        ids2 = second_turn(tok, first, f1.output_ids, key)
        # NOTE: reselect and as-is publish blocks under one identity: reselect runs first, so
        # as-is finds turn 1's blocks, not reselect's remade copies (those stay private anyway)
        for arm, llm, reuse in (
            ("reselect", filled, "reselect"),
            ("as-is", filled, "as-is"),
            ("never", filled, "never"),
            ("fresh", fresh, "never"),
        ):
            seq, row[f"{arm}:ttft"] = run(llm, ids2, reuse=reuse)
            row[arm] = answered(tok.decode(seq.output_ids), value)
            row[f"{arm}:cached"], row[f"{arm}:cached_filled"] = seq.prefix.num_cached, seq.prefix.cached_filled_rows
            row[f"{arm}:remade"], row[f"{arm}:exact_rows"] = len(seq.prefix.remade_rows), len(seq.fill.exact_rows)
            row[f"{arm}:text"] = tok.decode(seq.output_ids)
            if arm == "fresh":
                fresh_rows = set(seq.fill.exact_rows)
            if arm == "reselect":
                reselected = set(seq.fill.exact_rows)
        row["reselect_has_fresh_rows"] = fresh_rows <= reselected
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith(":text")}), flush=True)
    report(rows, args)


def report(rows: list[dict], args) -> None:
    def acc(arm, subset):
        return 100 * statistics.fmean(r[arm] for r in subset) if subset else float("nan")

    def paired(arm, ref, subset):
        m, lo, hi = paired_bootstrap([100 * (r[arm] - r[ref]) for r in subset])
        return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]"

    inside = [r for r in rows if r["needle_filled"]]
    print(
        f"\n{len(rows)} samples of {args.length} tokens, tail {args.tail}, threads {args.threads}; "
        f"second needle in the filled region in {len(inside)}"
    )
    print(
        "| arm | turn 2 accuracy (all) | vs exact | vs fresh | needle filled: accuracy | vs exact "
        "| turn-2 TTFT median s | cached tokens (filled rows) | rows remade exact (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in ARMS:
        cached = (
            "—"
            if arm == "exact"
            else (
                f"{statistics.median(r[arm + ':cached'] for r in rows):.0f} "
                f"({statistics.median(r[arm + ':cached_filled'] for r in rows):.0f})"
            )
        )
        vs_fresh = "—" if arm in ("exact", "fresh") else paired(arm, "fresh", rows)
        vs_exact = "—" if arm == "exact" else paired(arm, "exact", rows)
        vs_exact_in = "—" if arm == "exact" else paired(arm, "exact", inside)
        print(
            f"| {arm} | {acc(arm, rows):.1f}% | {vs_exact} | {vs_fresh} | {acc(arm, inside):.1f}% | {vs_exact_in} "
            f"| {statistics.median(r[arm + ':ttft'] for r in rows):.3f} | {cached} "
            f"| {'—' if arm == 'exact' else statistics.median(r[arm + ':remade'] for r in rows)} |"
        )
    print(f"turn 1 accuracy: exact {acc('exact:turn1', rows):.1f}%, filled {acc('fill:turn1', rows):.1f}%")
    print(
        f"reselect holds every row the fresh fill made exact in {sum(r['reselect_has_fresh_rows'] for r in rows)} "
        f"of {len(rows)} samples"
    )
    covered = [r["covered"] for r in inside]
    if covered:
        print(
            f"the first question's exact rows cover a median {100 * statistics.median(covered):.0f}% of the "
            f"second needle's tokens (needle in the filled region)"
        )
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
