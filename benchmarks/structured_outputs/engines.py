"""Grammar engines side by side on one tokenizer: llguidance (what ridgefill uses), xgrammar and
outlines-core.

Runs in whichever environment has the engine (xgrammar needs triton and transformers, so it
lives in a venv of its own); reads nothing of ridgefill but the test schemas' data and a Hugging
Face tokenizer folder (`ridgefill-export-tokenizer DIR`). For each schema it measures the compile
(and, for llguidance, whose compile is lazy, the first mask: the cost a new schema has before its
first token), then walks a valid output of it token by token, timing each mask and consume.

  python benchmarks/structured_outputs/engines.py --engine llguidance --tokenizer DIR --instances FILE
  /tmp/xgv/bin/python benchmarks/structured_outputs/engines.py --engine xgrammar --tokenizer DIR --instances FILE
  /tmp/ocv/bin/python benchmarks/structured_outputs/engines.py --engine outlines-core --tokenizer DIR --instances FILE
(outlines-core's venv: `pip install outlines-core numpy`; it needs no torch.)
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


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme): char -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class OutlinesCore:
    """outlines-core: a JSON Schema becomes a regex, the regex an index over the vocabulary (the
    compile), then a guide walks it. Its vocabulary is built from the tokenizer.json's byte-level
    tokens as bytes; special tokens other than the end of text are left out, as its own loader does."""

    def __init__(self, folder: Path, eos: int):
        import numpy
        import outlines_core

        self.oc, self.np = outlines_core, numpy
        t0 = time.perf_counter()
        doc = json.loads((folder / "tokenizer.json").read_text())
        alphabet = _byte_alphabet()
        special = {t["id"] for t in doc.get("added_tokens", []) if t.get("special")}
        tokens: dict[bytes, list[int]] = {}
        for text, i in doc["model"]["vocab"].items():
            if i == eos or i in special:
                continue
            tokens.setdefault(bytes(alphabet[c] for c in text), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, tokens)
        self.size = max(doc["model"]["vocab"].values()) + 1
        self.tokenizer_s = time.perf_counter() - t0
        self.mask = numpy.zeros((self.size + 31) // 32, dtype=numpy.int32)

    def compile(self, schema: dict):
        from outlines_core.json_schema import build_regex_from_schema

        # NOTE: outlines-core has no separator option; an optional space lets through the ", " and ": "
        # the other two engines are told to write (a looser language, so its refusals are not ours)
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="[ ]?")
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def step(self, guide, token: int) -> bool:
        guide.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
        try:
            guide.advance(token)
        except ValueError:
            return False
        return True


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=tuple(ENGINES), required=True)
    p.add_argument("--tokenizer", type=Path, required=True, help="a Hugging Face tokenizer folder")
    p.add_argument("--instances", type=Path, required=True, help="JSON: schema index -> token ids of a valid output")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="OMP/torch threads (masks here are single-row)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.engine != "outlines-core":
        import torch

        torch.set_num_threads(args.threads)
    data = json.loads(args.instances.read_text())
    eos = data["eos"]
    engine = ENGINES[args.engine](args.tokenizer, eos)
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
