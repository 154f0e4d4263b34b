"""`ridgefill tune`: search split × tail × exact-row policy for the fastest fill inside a quality
budget; writes fill.toml (the choice), tune.json (every measurement) and frontier.png."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..config import FillConfig
from ..errors import InputError
from ..fill.corpus import calibration_and_heldout, read_text
from ..fill.fit_cli import text_files
from ..fill.fitting import Document, fit_maps
from ..fill.maps import FillMaps, check_maps_fit
from ..fill.settings import PACKAGED_MAPS, needs_counts, shipped_maps, shipped_unigram
from ..operator_config import engine_config_of
from .rows_eval import SELECTOR_SETS
from .tune import BUDGET_RULE, BudgetError, Measured, TuneSettings, budget_of, choose, fill_toml, frontier
from .tune_measure import SpeedBench, arm_of, quality, speeds
from .tune_plot import draw_frontier

MIN_PREFIX = 64  # held-out rows before the longest tail: fewer leave the fill nothing to predict


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"expected comma-separated integers, got {text!r}") from None


def add_tune_parser(sub, engine_args) -> None:
    t = sub.add_parser("tune", help="choose split, tail and exact rows: the fastest fill inside a quality budget")
    engine_args(t, fill=False)  # NOTE: the fill is what tune chooses
    t.add_argument("--heldout", nargs="+", required=True, type=Path, help="held-out text files or folders (quality)")
    t.add_argument(
        "--calib",
        nargs="+",
        type=Path,
        default=None,
        help="calibration text files or folders, for splits without maps (default: the kernel-docs "
        "calibration of fill/corpus.py)",
    )
    t.add_argument("--maps-dir", type=Path, default=None, help="reuse maps-split{S}.safetensors from `ridgefill fit`")
    t.add_argument("--splits", required=True, help="candidate split layers, e.g. 11,15,20")
    t.add_argument("--tails", default=str(FillConfig().tail), help="candidate tails, e.g. 512,1024")
    t.add_argument(
        "--rows", default="special,lexical", help="candidate exact-row policies (eval/rows_eval.py's SELECTOR_SETS)"
    )
    t.add_argument("--unigram", default=None, help="token counts for the probe/protected policies (fill.rows.unigram)")
    budget = t.add_argument_group("budget (exactly one)")
    budget.add_argument("--max-novel-dnll", type=float, default=None, metavar="X", help="novel-token ΔNLL, nats")
    budget.add_argument("--max-key-dnll", type=float, default=None, metavar="X", help="key-token ΔNLL, nats")
    budget.add_argument(
        "--min-retrieval", type=float, default=None, metavar="F", help="needle retrieval, fraction of exact's"
    )
    t.add_argument("--length", type=int, default=4096, help="prompt tokens of the speed measurement")
    t.add_argument("--reps", type=int, default=3, help="timed exact/candidate pairs per candidate")
    t.add_argument("--max-doc-tokens", type=int, default=4096)
    t.add_argument("--calib-tokens", type=int, default=64_000, help="with the default calibration: tokens taken")
    t.add_argument("--needle-lengths", default="2048,3072", help="with --min-retrieval: needle prompt lengths")
    t.add_argument("--needles-per-task", type=int, default=4)
    t.add_argument(
        "--out", type=Path, required=True, help="writes fill.toml, tune.json, frontier.png (maps/ if fitted)"
    )
    t.set_defaults(handler=run_tune)


def run_tune(args) -> int:
    import torch

    from ..llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    budget = budget_of(args.max_novel_dnll, args.max_key_dnll, args.min_retrieval)
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    settings = TuneSettings(_ints(args.splits), _ints(args.tails), rows, budget, args.length, args.reps)
    config = engine_config_of(args)
    unigram = _unigram(args, settings, config.model)
    llm = LLM(config)
    model, tok = llm.engine.model, llm.tokenizer
    settings.check_layers(model.config.num_layers)
    texts = [(str(f), read_text(f)) for f in text_files(args.heldout)]
    if not texts:
        raise InputError(f"--heldout: no files in {', '.join(map(str, args.heldout))}")
    docs = _heldout_ids(tok, texts, args.max_doc_tokens, max(settings.tails))
    haystacks = _haystacks(texts) if budget.metric == "retrieval" else None
    # NOTE: built (and its exact run warmed up) before the long parts, so a prompt the engine
    # refuses (longer than the context, the K/V pool) stops the command at once
    bench = SpeedBench(model, tok, config, _speed_prompt(tok, texts, args.length), args.reps)
    maps_paths = _maps(args, config.model, model, tok, settings.splits)
    maps = {s: _checked_maps(model, s, p) for s, p in maps_paths.items()}
    arms = {c: arm_of(c, str(maps_paths[c.split]), maps[c.split], tok, unigram) for c in settings.candidates()}
    summary, per_doc, needles = quality(
        model, tok, arms, docs, haystacks, _ints(args.needle_lengths), args.needles_per_task
    )
    timing = speeds(bench, arms)
    measured = [Measured(c, summary[c.name], *timing[c]) for c in arms]
    try:
        chosen = choose(measured, budget)
    except BudgetError:
        _write_record(args, settings, measured, None, maps_paths, per_doc, needles, texts)
        raise
    _write_record(args, settings, measured, chosen, maps_paths, per_doc, needles, texts)
    note = (
        f"written by `ridgefill tune`: {chosen.candidate.name}, {chosen.speedup:.2f}x prefill at "
        f"{args.length} tokens,\n{budget.describes} {budget.value(chosen.quality):.4g} "
        f"(budget --{budget.option} {budget.limit:g}); every candidate: tune.json"
    )
    path = args.out / "fill.toml"
    path.write_text(fill_toml(chosen, maps_paths[chosen.candidate.split].resolve(), config.model, args.unigram, note))
    print(f"tune: chosen {chosen.candidate.name} ({chosen.speedup:.2f}x) -> {path}")
    if chosen.speedup <= 1.0:
        # NOTE: the choice stands (it is the rule's), but exact prefill would serve faster here
        print(
            f"tune: warning: no candidate inside the budget is faster than exact at --length {args.length} "
            f'(best {chosen.speedup:.2f}x); fill.mode = "off" prefills faster',
            file=sys.stderr,
        )
    return 0


def _unigram(args, settings: TuneSettings, model_name: str | None) -> str | None:
    """The counts the probe/protected policies read: --unigram, else the embedded model's shipped ones."""
    if args.unigram is not None:
        return args.unigram
    if model_name is None:
        return str(shipped_unigram())
    wanted = sorted({s for r in settings.rows for s in needs_counts(SELECTOR_SETS[r])})
    if wanted:
        raise InputError(f"--rows: {' and '.join(wanted)} need token counts for this model: give --unigram FILE")
    return None


def _heldout_ids(tok, texts: list[tuple[str, str]], max_tokens: int, longest_tail: int) -> list[list[int]]:
    docs = [tok.encode(text)[:max_tokens] for _, text in texts]
    docs = [ids for ids in docs if len(ids) > longest_tail + MIN_PREFIX]
    if not docs:
        raise InputError(
            f"--heldout: no document longer than the longest tail + {MIN_PREFIX} "
            f"({longest_tail + MIN_PREFIX} tokens, after --max-doc-tokens {max_tokens})"
        )
    return docs


def _haystacks(texts: list[tuple[str, str]]) -> list[str]:
    if len(texts) < 3:  # NOTE: needle_results samples 3 haystack texts per prompt
        raise InputError(f"--min-retrieval: needle prompts need at least 3 held-out files, got {len(texts)}")
    return [text for _, text in texts]


def _speed_prompt(tok, texts: list[tuple[str, str]], length: int) -> list[int]:
    ids: list[int] = []
    for _, text in texts:
        ids += tok.encode(text)
        if len(ids) >= length:
            return ids[:length]
    raise InputError(f"--length {length}: the held-out files hold only {len(ids)} tokens")


def _maps(args, model_name: str | None, model, tok, splits: tuple[int, ...]) -> dict[int, Path]:
    """Map file per split: --maps-dir's, else the shipped ones of the embedded or a packaged
    model, else fitted here into OUT/maps from the calibration text."""
    found: dict[int, Path] = {}
    packaged = model_name if model_name in PACKAGED_MAPS else None
    for s in splits:
        given = args.maps_dir / f"maps-split{s}.safetensors" if args.maps_dir else None
        if given is not None and given.exists():
            found[s] = given
        elif (model_name is None or packaged) and shipped_maps(s, packaged).exists():
            found[s] = shipped_maps(s, packaged)
    missing = [s for s in splits if s not in found]
    if missing:
        calib = _calibration(args, tok)
        # NOTE: λ is chosen on calibration documents kept out of the sums, never on --heldout,
        # which judges the result
        held, fit_docs = (calib[::5], [d for i, d in enumerate(calib) if i % 5]) if len(calib) > 1 else (calib, calib)
        try:
            report = fit_maps(model, model.identity, fit_docs, held, missing, args.out / "maps", tok.special_ids)
        except ValueError as e:
            raise InputError(str(e)) from None
        found.update({int(s): args.out / "maps" / e["maps"] for s, e in report["splits"].items()})
    return found


def _checked_maps(model, split: int, path: Path) -> FillMaps:
    maps = FillMaps(path, "resident", model.dtype, model.device)
    check_maps_fit(maps.meta, model.identity, model.config, split, str(path))
    return maps


def _calibration(args, tok) -> list[Document]:
    if args.calib:
        paths = text_files(args.calib)
        docs = [Document(str(p), tuple(tok.encode(read_text(p))[: args.max_doc_tokens])) for p in paths]
    else:
        try:
            corpus, _ = calibration_and_heldout()
        except FileNotFoundError as e:
            raise InputError(f"no --calib given and the default calibration text is missing: {e}") from None
        docs, total = [], 0
        for d in corpus:
            if total >= args.calib_tokens:
                break
            docs.append(Document(d.path, tuple(tok.encode(d.text)[: args.max_doc_tokens])))
            total += len(docs[-1].ids)
    docs = [d for d in docs if len(d.ids) >= 64]  # NOTE: as `ridgefill fit`: too short to fit a long-context fill
    if not docs:
        raise InputError("no calibration document of at least 64 tokens")
    return docs


def _write_record(args, settings, measured, chosen, maps_paths, per_doc, needles, texts) -> None:
    budget = settings.budget
    on_frontier = {m.candidate for m in frontier(measured, budget)}
    record = {
        "budget": {"flag": f"--{budget.option}", "limit": budget.limit, "value": budget.describes, "rule": BUDGET_RULE},
        "chosen": chosen.candidate.name if chosen else None,
        "speed_prompt_tokens": settings.length,
        "reps": settings.reps,
        "threads": _threads(),
        "heldout": [path for path, _ in texts],
        "candidates": [
            {
                "name": m.candidate.name,
                "split": m.candidate.split,
                "tail": m.candidate.tail,
                "rows": m.candidate.rows,
                "selectors": list(m.candidate.selectors),
                "maps": str(maps_paths[m.candidate.split]),
                "quality": m.quality,
                "budget_value": budget.value(m.quality),
                "inside_budget": budget.allows(budget.value(m.quality)),
                "on_frontier": m.candidate in on_frontier,
                "exact_s": m.exact_s,
                "fill_s": m.fill_s,
                "speedup": m.speedup,
            }
            for m in measured
        ],
        "documents": {str(t): rows for t, rows in per_doc.items()},
        "needles": {str(t): rows for t, rows in needles.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(record, indent=1))
    title = f"ridgefill tune: {len(measured)} candidates, speed at {settings.length} tokens"
    draw_frontier(measured, budget, chosen, args.out / "frontier.png", title)
    for m in sorted(measured, key=lambda m: -m.speedup):
        value = budget.value(m.quality)
        shown = "n/a" if math.isnan(value) else f"{value:+.4f}"
        mark = " <- chosen" if chosen is m else ("" if budget.allows(value) else " (outside budget)")
        print(f"tune: {m.candidate.name:<24} {shown:>9}  {m.speedup:5.2f}x{mark}", file=sys.stdout)


def _threads() -> int:
    import torch

    return torch.get_num_threads()
