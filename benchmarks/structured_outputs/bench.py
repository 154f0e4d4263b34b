"""Structured outputs' cost on the CPU: grammar compile time per schema, mask time per row, and
decode-step time with and without a schema at B = 1 and B = 16 (the embedded SmolLM2).

  compile   for each test schema (tests/grammar/schemas.py) on a fresh GrammarBook: the compile
            (llguidance builds lazily, so also the first mask), median of --reps
  mask      Constrainer.mask alone (bitmask fill + unpack + apply) per step, at B rows
  decode    engine.step() while every sequence decodes: B unconstrained greedy requests vs B
            requests each under a JSON Schema (greedy), one engine, alternated --reps times;
            ratio = constrained / unconstrained step time (medians)

  .venv/bin/python benchmarks/structured_outputs/bench.py --threads 2 --out benchmarks/structured_outputs/results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "grammar"))

from ridgefill_runtime.config import CacheConfig, EngineConfig, StructuredConfig  # noqa: E402
from ridgefill_runtime.grammar.book import GrammarBook  # noqa: E402
from ridgefill_runtime.grammar.masks import mask_words  # noqa: E402
from ridgefill_runtime.grammar.spec import json_schema_spec  # noqa: E402
from ridgefill_runtime.llm import build_engine  # noqa: E402
from ridgefill_runtime.sequence import SamplingParams  # noqa: E402
from schemas import PERSON, SCHEMAS  # noqa: E402

# a schema whose outputs run long: decode steps stay constrained for all the timed steps
LONG = {"type": "array", "items": PERSON, "minItems": 8, "maxItems": 8}


def compile_times(tokenizer, reps: int) -> list[dict]:
    rows = []
    book = GrammarBook(tokenizer, StructuredConfig())
    book.compile(json_schema_spec({"type": "boolean"}, "warm"))  # builds the token trie once (not per schema)
    for what, schema in SCHEMAS:
        times = []
        for _ in range(reps):
            fresh = GrammarBook(tokenizer, StructuredConfig())
            fresh._engine_tokenizer = book._engine_tokenizer  # NOTE: the tokenizer is per model, not per schema
            spec = json_schema_spec(schema, "bench")
            t0 = time.perf_counter()
            fresh.compile(spec)
            matcher = fresh.matcher(spec)
            bitmask = torch.zeros(1, mask_words(fresh.vocab_size), dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            times.append(time.perf_counter() - t0)
        rows.append({"schema": what, "compile_and_first_mask_ms": 1000 * statistics.median(times)})
    return rows


def prompt(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def decode_steps(engine, batch: int, spec, steps: int) -> tuple[list[float], list[float]]:
    """Time `steps` decode steps of `batch` sequences (after their prefill); also the mask's share."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True, grammar=spec)
    seqs = [engine.add_request(prompt(engine, f"List eight people as JSON ({i})."), params) for i in range(batch)]
    while any(s.num_computed < len(s.prompt_ids) for s in seqs):
        engine.step()
    constrainer = engine.runner.constrainer
    inner = constrainer.mask
    mask_times: list[float] = []

    def timed_mask(*a):
        t0 = time.perf_counter()
        out = inner(*a)
        mask_times.append(time.perf_counter() - t0)
        return out

    constrainer.mask = timed_mask
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        constrainer.mask = inner
        for s in seqs:
            engine.abort(s)
    return times, mask_times if spec is not None else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(EngineConfig(cache=CacheConfig(num_blocks=512)))
    t0 = time.perf_counter()
    GrammarBook(engine.tokenizer, StructuredConfig())._llm_tokenizer()
    tokenizer_s = time.perf_counter() - t0
    compiles = compile_times(engine.tokenizer, args.reps)
    spec = json_schema_spec(LONG, "bench")
    engine.grammars.compile(spec)
    decode = []
    for batch in (1, 16):
        plain, constrained, masks = [], [], []
        for _ in range(args.reps):  # NOTE: alternated, so drift hits both alike
            plain += decode_steps(engine, batch, None, args.steps)[0]
            times, mask_times = decode_steps(engine, batch, spec, args.steps)
            constrained += times
            masks += mask_times
        row = {
            "batch": batch,
            "step_ms_unconstrained": 1000 * statistics.median(plain),
            "step_ms_schema": 1000 * statistics.median(constrained),
            "mask_ms": 1000 * statistics.median(masks),
        }
        row["ratio"] = row["step_ms_schema"] / row["step_ms_unconstrained"]
        decode.append(row)
    ms = [r["compile_and_first_mask_ms"] for r in compiles]
    summary = {
        "threads": args.threads,
        "load_average_1min_at_end": os.getloadavg()[0],
        "tokenizer_build_s": tokenizer_s,
        "compile_ms_median": statistics.median(ms),
        "compile_ms_max": max(ms),
        "decode": decode,
    }
    print(f"threads {args.threads}; tokenizer for the grammar engine built once per model: {tokenizer_s:.2f} s")
    print(
        f"compile + first mask, {len(ms)} schemas: median {summary['compile_ms_median']:.2f} ms, max {max(ms):.2f} ms"
    )
    print("| B | step, no schema (ms) | step, schema (ms) | ratio | mask alone (ms) |")
    print("|---|---|---|---|---|")
    for r in decode:
        print(
            f"| {r['batch']} | {r['step_ms_unconstrained']:.1f} | {r['step_ms_schema']:.1f} | "
            f"{r['ratio']:.3f} | {r['mask_ms']:.2f} |"
        )
    print(f"load average (1 min) at the end: {summary['load_average_1min_at_end']:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "compile": compiles}, indent=1))


if __name__ == "__main__":
    main()
