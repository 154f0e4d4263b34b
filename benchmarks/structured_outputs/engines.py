"""Grammar engines side by side on one tokenizer: llguidance (what ridgefill uses) and xgrammar.

Runs in whichever environment has the engine (xgrammar needs triton and transformers, so it
lives in a venv of its own); reads nothing of ridgefill but the test schemas' data and a Hugging
Face tokenizer folder (`ridgefill-export-tokenizer DIR`). For each schema it measures the compile
(and, for llguidance, whose compile is lazy, the first mask: the cost a new schema has before its
first token), then walks a valid output of it token by token, timing each mask and consume.

  python benchmarks/structured_outputs/engines.py --engine llguidance --tokenizer DIR --instances FILE
  /tmp/xgv/bin/python benchmarks/structured_outputs/engines.py --engine xgrammar --tokenizer DIR --instances FILE
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "grammar"))

from schemas import SCHEMAS  # noqa: E402

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Llguidance:
    def __init__(self, folder: Path, eos: int):
        import llguidance
        import llguidance.torch  # noqa: F401

        self.lg = llguidance
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer((folder / "tokenizer.json").read_text(), eos_token=eos)
        self.tokenizer_s = time.perf_counter() - t0
        self.words = (self.tok.vocab_size + 31) // 32

    def compile(self, schema: dict):
        import torch

        grammar = self.lg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
        matcher = self.lg.LLMatcher(self.tok, grammar, log_level=0)
        self.mask = torch.zeros(1, self.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.words * 4)  # the lazy part: first mask
        matcher.reset()
        return matcher

    def step(self, matcher, token: int) -> bool:
        matcher.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.words * 4)
        return matcher.consume_token(token)


class Xgrammar:
    def __init__(self, folder: Path, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xg = xgrammar
        t0 = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.tokenizer_s = time.perf_counter() - t0
        self.mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return self.xg.GrammarMatcher(compiled)

    def step(self, matcher, token: int) -> bool:
        matcher.fill_next_token_bitmask(self.mask)
        return matcher.accept_token(token)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("llguidance", "xgrammar"), required=True)
    p.add_argument("--tokenizer", type=Path, required=True, help="a Hugging Face tokenizer folder")
    p.add_argument("--instances", type=Path, required=True, help="JSON: schema index -> token ids of a valid output")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="OMP/torch threads (masks here are single-row)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    data = json.loads(args.instances.read_text())
    eos = data["eos"]
    engine = (Llguidance if args.engine == "llguidance" else Xgrammar)(args.tokenizer, eos)
    compile_ms, step_us, refused = [], [], []
    for i, (what, schema) in enumerate(SCHEMAS):
        ids = data["instances"].get(str(i))
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            matcher = engine.compile(schema)
            times.append(time.perf_counter() - t0)
        compile_ms.append(1000 * statistics.median(times))
        if ids is None:
            continue
        for token in ids:
            t0 = time.perf_counter()
            ok = engine.step(matcher, token)
            step_us.append(1e6 * (time.perf_counter() - t0))
            if not ok:
                refused.append(what)
                break
    step_us.sort()
    summary = {
        "engine": args.engine,
        "threads": args.threads,
        "tokenizer_build_s": engine.tokenizer_s,
        "compile_ms_median": statistics.median(compile_ms),
        "compile_ms_max": max(compile_ms),
        "mask_and_consume_us_median": statistics.median(step_us),
        "mask_and_consume_us_p90": step_us[int(0.9 * len(step_us))],
        "tokens": len(step_us),
        "refused_instances": refused,
        "load_average_1min": os.getloadavg()[0],
    }
    print(json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
