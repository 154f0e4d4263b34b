"""`python -m ridgefill_server ...`: the `ridgefill` command (server/main.py) without the console script
(tests, scripts)."""

from __future__ import annotations

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
