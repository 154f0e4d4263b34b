"""`ridgefill`, the console command: `serve` is the server's, every other command the runtime's.

The runtime (ridgefill_runtime/cli.py) never imports the server; this dispatcher adds `serve` to
its parser, so `ridgefill --help` lists every command.
"""

from __future__ import annotations

import argparse
import sys

from .cli_serve import add_serve_parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # NOTE: the runtime's module is light to import (no torch) but its full parser is not: it
    # imports the fit and eval commands, hence torch, and a bad serve flag must fail in well
    # under a second. So `serve` gets a parser of its own.
    from ridgefill_runtime import cli

    if argv[:1] == ["serve"]:
        args = serve_parser().parse_args(argv)
        return cli.run_reporting_errors(args.handler, args)
    return cli.main(argv, extra_commands=add_serve_parser)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ridgefill", description="RidgeFill LLM inference")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, serve included (what `ridgefill --help` shows)."""
    from ridgefill_runtime.cli import build_parser as runtime_parser

    return runtime_parser(extra_commands=add_serve_parser)


if __name__ == "__main__":
    sys.exit(main())
