"""One entry point: a path (HF folder or .gguf file, or None for the embedded default)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelLoadError
from .checkpoint import Checkpoint


def load_checkpoint(path: str | os.PathLike | None) -> Checkpoint:
    if path is None:
        from .gguf import default_model_path
        path = default_model_path()
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: model path not found")
    if p.is_dir():
        from .hf import load_hf_folder
        return load_hf_folder(p)
    if p.suffix == ".gguf":
        from .gguf import load_gguf
        return load_gguf(p)
    raise ModelLoadError(f"{p}: expected a Hugging Face checkpoint folder or a .gguf file")
