"""One entry point: a path (HF folder or .gguf file, None for the embedded default, or the name of
an embedded model: "looped", the small Huginn-layout demonstration model trained here)."""

from __future__ import annotations

import os

from ..errors import ModelLoadError
from .checkpoint import Checkpoint
from .embedded import model_path


def load_checkpoint(path: str | os.PathLike | None, packed: bool = False) -> Checkpoint:
    """packed: a GGUF's quantized linear weights stay quantized (loader/gguf.py packed_tensors);
    a Hugging Face folder has none, so it loads as it always does."""
    if path is None:
        from .gguf import default_model_path

        path = default_model_path()
    p = model_path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: model path not found")
    if p.is_dir():
        from .hf import load_hf_folder

        return load_hf_folder(p)
    if p.suffix == ".gguf":
        from .gguf import load_gguf

        return load_gguf(p, packed=packed)
    raise ModelLoadError(f"{p}: expected a Hugging Face checkpoint folder or a .gguf file")
