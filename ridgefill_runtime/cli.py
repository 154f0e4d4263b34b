"""`ridgefill generate | score | fit | eval | tune`: the runtime's commands. Errors print as one line,
not a traceback.

The `ridgefill` console command is server/main.py, which adds `serve` through `extra_commands`
and hands every other command here; the runtime never imports the server.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import FILL_ARMS
from .errors import InputError, RidgefillError
from .operator_config import add_engine_flags, engine_config_of, fill_mode_of_arm


def _engine_args(p: argparse.ArgumentParser, fill: bool = True) -> None:
    """--config (the operator file `serve` reads), the engine flags `serve` has (without the
    --fill-* ones for a command that sets its own fill), and --threads."""
    add_engine_flags(p, fill=fill)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _fill_args(p: argparse.ArgumentParser, arm_help: str) -> None:
    """The older fill spellings of generate and score, in FillConfig's words; scripts and notes use them."""
    p.add_argument(
        "--fill-config",
        default=None,
        help="the same as --config (an older spelling, when only the file's [fill] table was read)",
    )
    p.add_argument(
        "--arm",
        default=None,
        choices=FILL_ARMS,
        help=arm_help + "; --fill-mode in FillConfig's words (plain: ridgefill)",
    )
    p.add_argument(
        "--selectors",
        default=None,
        metavar="A,B,C",
        help="exact prefix row selectors, comma-separated (special, attention, probe, lexical, "
        "protected, digits); the same as --fill-selectors",
    )


# Called with the parser's subparsers to add commands; each sets a `handler` default
# (args -> exit status), which `main` runs instead of the runtime's own commands.
ExtraCommands = Callable[[Any], None]


def build_parser(extra_commands: ExtraCommands | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ridgefill", description="RidgeFill LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt, streaming to stdout")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    _fill_args(g, "prefix handling of the prompt (default: exact)")

    s = sub.add_parser("score", help="per-token log-probabilities of a text under the model")
    _engine_args(s)
    s.add_argument(
        "--text-file",
        required=True,
        type=Path,
        nargs="+",
        help="one or more text files, each scored alone (the model loads once)",
    )
    s.add_argument(
        "--json", action="store_true", help="print one JSON object per file, one per line (the only format for now)"
    )
    _fill_args(s, "prefix handling; fill arms score only the rows they compute exactly (the tail)")

    f = sub.add_parser("fit", help="fit RidgeFill maps: one capture pass, then a ridge solve per late layer")
    _engine_args(f, fill=False)
    f.add_argument("--calib", nargs="+", required=True, type=Path, help="calibration text files or folders")
    f.add_argument("--heldout", nargs="+", required=True, type=Path, help="held-out text files or folders (λ choice)")
    f.add_argument("--splits", required=True, help="comma-separated split layers, e.g. 12,15,18")
    f.add_argument("--out", required=True, type=Path)
    f.add_argument("--max-doc-tokens", type=int, default=4096)
    f.add_argument(
        "--terminal-state",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="hybrids: also fit the terminal-state correction's ΔM on these texts (keep them apart "
        "from --calib and from evaluation text), stored in each split's map file",
    )
    f.add_argument(
        "--terminal-every",
        type=int,
        default=2048,
        metavar="N",
        help="measure the exact - filled state gap every N tokens (default 2048)",
    )

    from .eval.cli import add_eval_parser

    add_eval_parser(sub, _engine_args)

    from .eval.tune_cli import add_tune_parser

    add_tune_parser(sub, _engine_args)

    if extra_commands is not None:
        extra_commands(sub)
    return parser


def main(argv: list[str] | None = None, extra_commands: ExtraCommands | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(extra_commands).parse_args(argv)
    return run_reporting_errors(getattr(args, "handler", _run), args)


def run_reporting_errors(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """handler(args), with a RidgefillError printed as one line (status 1), not a traceback."""
    try:
        return handler(args)
    except RidgefillError as e:
        print(f"ridgefill: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl+C before anything took over the signal (e.g. during imports)
        return 130


def _run(args) -> int:
    import torch

    from .llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command in ("eval", "fit"):
        config = engine_config_of(args)
        if args.command == "eval":
            from .eval.cli import run_eval

            return run_eval(args, LLM(config), config)
        from .fill.fit_cli import run_fit

        return run_fit(args, config)
    if args.fill_config is not None:
        if args.config is not None:
            raise InputError("give --config or --fill-config (its older spelling), not both")
        args.config = args.fill_config
    config = engine_config_of(
        args, {"fill.mode": fill_mode_of_arm(args.arm), "fill.rows.selectors": parse_selectors(args.selectors)}
    )
    if args.command == "score":
        return _score(LLM(config), args)
    return _generate(LLM(config), args)


def parse_selectors(text: str | None) -> list[str] | None:
    """`--selectors a,b,c` -> ["a", "b", "c"] (None: not given); an unknown name is an InputError."""
    if text is None:
        return None
    from .config import SELECTORS

    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in SELECTORS:
            raise InputError(f"--selectors: unknown selector {name!r} (known: {', '.join(SELECTORS)})")
    return names


def _generate(llm, args) -> int:
    from .sequence import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    engine = llm.engine
    seq = engine.add_request(llm.encode(args.prompt, chat=args.chat), params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.seq is seq and out.delta_text:
                sys.stdout.write(out.delta_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _score(llm, args) -> int:
    from .errors import InputError

    texts = []
    for path in args.text_file:  # NOTE: every file is read and checked before any is scored
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: cannot read text file ({e})") from None
    encoded = [llm.encode(text) for text in texts]
    for path, ids in zip(args.text_file, encoded):
        if len(ids) < 2:
            raise InputError(f"{path}: needs at least 2 tokens to score, has {len(ids)}")
    for ids in encoded:
        print(json.dumps(llm.score(ids)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
