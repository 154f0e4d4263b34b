"""`ridgefill fit`: read the text files, tokenize, and run the fit driver."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..models.hybrid_config import HybridConfig
from .corpus import read_text
from .fitting import Document, fit_maps
from .maps import FillMaps, add_terminal_shift
from .terminal_fit import fit_terminal_shift


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
    terminal = getattr(args, "terminal_state", None)
    if terminal and not isinstance(model.config.family_config, HybridConfig):
        raise InputError("--terminal-state: the model has no Gated DeltaNet layers to correct")
    if terminal and args.terminal_every < 1:
        raise InputError(f"--terminal-every must be >= 1, got {args.terminal_every}")
    calib = tokenize_docs(llm.tokenizer, args.calib, args.max_doc_tokens)
    held = tokenize_docs(llm.tokenizer, args.heldout, args.max_doc_tokens)
    report = fit_maps(model, model.identity, calib, held, splits, args.out, llm.tokenizer.special_ids)
    if terminal:
        # NOTE: no --max-doc-tokens cut: the correction is measured along whole long prompts
        prompts = tokenize_docs(llm.tokenizer, terminal, 1 << 30)
        for split, entry in report["splits"].items():
            fit_terminal_into(model, args.out / entry["maps"], prompts, int(split), args.terminal_every)
    return 0


def fit_terminal_into(model, path: Path, prompts: list[Document], split: int, every: int, log=print) -> int:
    """Fit ΔM for the maps at `path` (the filled states use those maps) and store it there."""
    maps = FillMaps(path, "resident", model.dtype, model.device)
    shifts, states = fit_terminal_shift(model, maps, [list(d.ids) for d in prompts], split, every)
    add_terminal_shift(path, shifts, every, states)
    log(f"fit: split {split}: terminal-state ΔM for {len(shifts)} GDN layers from {states} states -> {path}")
    return states
