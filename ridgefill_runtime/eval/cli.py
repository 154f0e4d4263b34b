"""`ridgefill eval`: the fill arms against exact on the local evaluation documents."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import EngineConfig, FillConfig
from ..fill.corpus import evaluation_docs
from ..fill.maps import FillMaps, check_maps_fit
from ..fill.settings import PACKAGED_MAPS, shipped_maps
from .run import Arm, document_measures, markdown, needle_results, splices_for, summarize

# the arm name for RidgeFill with the terminal-state correction (Flash-Next's quality mode)
TERMINAL_ARM = "ridgefill+terminal"


def add_eval_parser(sub, engine_args) -> None:
    e = sub.add_parser("eval", help="each fill arm paired with exact: ΔNLL, KL, agreement, needles, splices")
    engine_args(e, fill=False)  # NOTE: --split, --tail, --maps below are the arms' fill settings
    e.add_argument("--split", type=int, default=None, help="fill.split of every arm (default: --config's fill.split)")
    e.add_argument("--tail", type=int, default=None, help="fill.tail of every arm (default: --config's fill.tail)")
    e.add_argument(
        "--maps",
        default=None,
        help="map file (default: --config's fill.maps when its split is --split's, else the shipped maps for --split)",
    )
    e.add_argument(
        "--arms",
        default="nofill,identity,ridgefill",
        help=f"comma-separated: nofill, identity, ridgefill, {TERMINAL_ARM} (hybrids, maps with ΔM)",
    )
    e.add_argument("--docs", type=int, default=10, help="documents of 4K-8K tokens")
    e.add_argument("--max-doc-tokens", type=int, default=8000)
    e.add_argument("--needles-per-task", type=int, default=4)
    e.add_argument("--needle-lengths", default="2048,3072")
    e.add_argument("--value-rescale", action="store_true")
    e.add_argument("--key-rescale", action="store_true")
    e.add_argument("--no-splices", action="store_true")
    e.add_argument("--out", type=Path, default=Path("eval-out"))


def arms_fill(args, config: EngineConfig) -> tuple[int, int, str]:
    """(split, tail, map file) of every arm: --split, --tail and --maps, else the engine's fill
    (--config and the flags; a packaged model's split when none is set), else the shipped maps."""
    split = config.fill.split if args.split is None else args.split
    tail = config.fill.tail if args.tail is None else args.tail
    packaged = config.model if config.model in PACKAGED_MAPS else None
    configured = config.fill.maps if config.fill.split == split else None
    return split, tail, args.maps or configured or str(shipped_maps(split, packaged))


def run_eval(args, llm, config: EngineConfig) -> int:
    model, tok = llm.engine.model, llm.tokenizer
    split, tail, maps_path = arms_fill(args, config)
    maps = FillMaps(maps_path, "resident", model.dtype, model.device)
    check_maps_fit(maps.meta, model.identity, model.config, split, maps_path)
    arms = []
    for name in args.arms.split(","):
        arm, terminal = ("ridgefill", True) if name == TERMINAL_ARM else (name, False)
        fill = FillConfig(
            arm=arm,
            split=split,
            tail=tail,
            maps=maps_path if arm == "ridgefill" else None,
            value_rescale=args.value_rescale and arm != "nofill",
            key_rescale=args.key_rescale and arm != "nofill",
            terminal_state=terminal,
        )
        arms.append(Arm(name, fill, maps if arm == "ridgefill" else None))
    texts = evaluation_docs()
    docs = []
    for d in texts:
        ids = tok.encode(d.text)
        if len(ids) >= 4096:
            docs.append((d, ids[: args.max_doc_tokens]))
        if len(docs) == args.docs:
            break
    t0 = time.time()
    splice_arm = None if args.no_splices or "ridgefill" not in args.arms else "ridgefill"
    per_doc = []
    for i, (d, ids) in enumerate(docs):
        r = document_measures(model, ids, arms, tail, splice_arm)
        r.update(path=d.path, sha256=d.sha256)
        per_doc.append(r)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "documents.partial.json").write_text(json.dumps(per_doc, indent=1))  # NOTE: survives a crash later
        print(
            f"eval: doc {i + 1}/{len(docs)} ({len(ids)} tokens, {r['key']} key, {r['novel']} novel) "
            f"{time.time() - t0:.0f}s",
            flush=True,
        )
    lengths = [int(x) for x in args.needle_lengths.split(",")]
    haystacks = [d.text for d in texts[len(docs) :]]
    needles = needle_results(model, tok, arms, haystacks, lengths, args.needles_per_task, tail)
    names = [a.name for a in arms] + ([f"{splice_arm}+exact_{w}" for w in splices_for(model)] if splice_arm else [])
    summary = summarize(per_doc, needles, names)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "split": split,
        "tail": tail,
        "maps": maps_path,
        "lambda": maps.meta.lam,
        "value_rescale": args.value_rescale,
        "key_rescale": args.key_rescale,
        "documents": per_doc,
        "needles": needles,
        "summary": summary,
    }
    (args.out / "eval.json").write_text(json.dumps(record, indent=1))
    table = markdown(summary, names)
    header = (
        f"split {split}/{model.config.num_layers}, tail {tail}, {len(per_doc)} documents, "
        f"{summary['needles_in_prefix']} needle prompts ({summary['needles_solved_by_exact']} solved by exact); "
        "mean arm − exact with paired bootstrap 95% intervals\n\n"
    )
    (args.out / "eval.md").write_text(header + table + "\n")
    print(header + table)
    return 0
