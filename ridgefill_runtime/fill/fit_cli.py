"""`ridgefill fit`: read the text files, tokenize, and run the fit driver."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from .corpus import read_text
from .fitting import Document, fit_maps


def text_files(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise InputError(f"{p}: no such file or folder")
    return out


def tokenize_docs(tokenizer, paths: list[Path], max_tokens: int) -> list[Document]:
    docs = []
    for f in text_files(paths):
        ids = tokenizer.encode(read_text(f))[:max_tokens]
        if len(ids) >= 64:  # NOTE: too short to say anything about a long-context fill
            docs.append(Document(str(f), tuple(ids)))
    if not docs:
        raise InputError(f"no usable documents (>= 64 tokens) in {', '.join(map(str, paths))}")
    return docs


def run_fit(args, config) -> int:
    from ..llm import LLM

    llm = LLM(config)
    try:
        splits = sorted({int(s) for s in args.splits.split(",")})
    except ValueError:
        raise InputError(f"--splits must be comma-separated integers, got {args.splits!r}") from None
    model = llm.engine.model
    bad = [s for s in splits if not 0 < s < model.config.num_layers]
    if bad:
        raise InputError(f"--splits: {bad[0]} is not a layer in 1..{model.config.num_layers - 1}")
    calib = tokenize_docs(llm.tokenizer, args.calib, args.max_doc_tokens)
    held = tokenize_docs(llm.tokenizer, args.heldout, args.max_doc_tokens)
    fit_maps(model, model.identity, calib, held, splits, args.out, llm.tokenizer.special_ids)
    return 0
