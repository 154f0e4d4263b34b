"""Count token ids over the calibration documents of the shipped maps, for the protected-token rule.

    python scripts/count_unigrams.py [--manifest ridgefill_runtime/data/maps/manifest.json]

The documents are exactly those the manifest lists under "calibration" (by sha256), taken from
fill/corpus.py's calibration set (Debian linux-doc-6.1) and tokenized the way
scripts/fit_default_maps.py tokenized them for the fit: the embedded GGUF's tokenizer, `encode`
with its default special-token handling, cut at the fit's per-document limit. Each document's
token count is checked against the manifest, so counts and maps describe the same text.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import gguf

from ridgefill_runtime.fill.corpus import calibration_and_heldout
from ridgefill_runtime.fill.settings import SHIPPED_DIR
from ridgefill_runtime.fill.tokens import save_counts
from ridgefill_runtime.loader.gguf import default_model_path, file_sha256
from ridgefill_runtime.loader.tokenizer import Tokenizer

OUT_NAME = "smollm2-135m-instruct.unigram.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", type=Path, default=SHIPPED_DIR / "manifest.json")
    ap.add_argument("--max-doc-tokens", type=int, default=4096, help="as fit_default_maps.py")
    ap.add_argument("--out", type=Path, default=SHIPPED_DIR / OUT_NAME)
    args = ap.parse_args()

    manifest = json.loads(args.manifest.read_text())
    model_path = default_model_path()
    identity = file_sha256(model_path)
    if identity != manifest["model_identity"]:
        raise SystemExit(
            f"{model_path} (sha256 {identity}) is not the model the maps were fit on ({manifest['model_identity']})"
        )
    tokenizer = Tokenizer.from_gguf_metadata(gguf.GGUFReader(str(model_path)))

    wanted = manifest["calibration"]
    calib = {d.sha256: d for d in calibration_and_heldout()[0]}
    missing = [w["path"] for w in wanted if w["sha256"] not in calib]
    if missing:
        raise SystemExit(f"calibration documents not found (or changed): {missing}")

    counts: Counter[int] = Counter()
    total = 0
    for w in wanted:
        ids = tokenizer.encode(calib[w["sha256"]].text)[: args.max_doc_tokens]
        if len(ids) != w["tokens"]:
            raise SystemExit(f"{w['path']}: {len(ids)} tokens, the manifest says {w['tokens']}")
        counts.update(ids)
        total += len(ids)

    meta = {
        "model": manifest["model"],
        "model_identity": identity,
        "tokenizer": f"GGUF tokenizer of {model_path.name}",
        "vocab_size": tokenizer.vocab_size,
        "source": "calibration documents of data/maps/manifest.json (Debian linux-doc-6.1)",
        "max_doc_tokens": args.max_doc_tokens,
        "documents": len(wanted),
        "total_tokens": total,
        "documents_sha256": [w["sha256"] for w in wanted],
    }
    save_counts(args.out, [counts.get(i, 0) for i in range(tokenizer.vocab_size)], meta)
    print(
        f"{args.out}: {len(wanted)} documents, {total} tokens, {len(counts)} distinct ids, "
        f"{args.out.stat().st_size} bytes"
    )


if __name__ == "__main__":
    main()
