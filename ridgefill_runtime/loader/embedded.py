"""Models shipped inside the package, by name (torch-free: the server's config check reads it)."""

from __future__ import annotations

import os
from pathlib import Path

# "looped": the small Huginn-layout demonstration model trained here (scripts/train_looped.py)
EMBEDDED = {"looped": Path(__file__).resolve().parent.parent / "data" / "looped"}


def model_path(path: str | os.PathLike) -> Path:
    """The path of a model argument: an embedded model's name, a packaged model's name (PyPI chunk
    packages put together on first use, loader/packaged.py), or the path itself."""
    from .packaged import PACKAGED, packaged_model_path

    if str(path) in PACKAGED:
        return packaged_model_path(str(path))
    return EMBEDDED.get(str(path), Path(path))
