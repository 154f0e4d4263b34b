"""Where converted checkpoints are kept between runs.

Order: `$RIDGEFILL_CACHE_DIR`, else `$XDG_CACHE_HOME/ridgefill`, else `~/.cache/ridgefill`.
Nothing is created here; writers create the folders they need.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "RIDGEFILL_CACHE_DIR"


def user_cache_dir() -> Path:
    """The root of ridgefill's cache, following the environment at call time (tests change it)."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # XDG says a relative value is invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "ridgefill"
    return Path.home() / ".cache" / "ridgefill"
