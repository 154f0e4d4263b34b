"""`python -m server serve ...`: the serve command without the main CLI (tests, scripts)."""

from __future__ import annotations

import argparse
import sys

from ridgefill_runtime.errors import RidgefillError

from .cli_serve import add_serve_parser, run_serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except RidgefillError as e:
        print(f"ridgefill: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl+C before the server took over the signal (e.g. during imports)
        return 130


if __name__ == "__main__":
    sys.exit(main())
