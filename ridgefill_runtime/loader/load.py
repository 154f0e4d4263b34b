"""One entry point: a path (HF folder or .gguf file, None for the embedded default, or the name of
an embedded model: "looped", the small Huginn-layout demonstration model trained here)."""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator

from ..errors import ModelLoadError, RidgefillError
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
    with naming_the_file(str(p)):
        if p.is_dir():
            from .hf import load_hf_folder

            return load_hf_folder(p)
        if p.suffix == ".gguf":
            from .gguf import load_gguf

            return load_gguf(p, packed=packed)
    raise ModelLoadError(f"{p}: expected a Hugging Face checkpoint folder or a .gguf file")


# What a damaged or unreadable file raises from the readers below ours (numpy, gguf, safetensors, json).
_FILE_CONTENT_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, EOFError, struct.error)


@contextlib.contextmanager
def naming_the_file(source: str) -> Iterator[None]:
    """Errors while reading or building from the model at `source` as one ModelLoadError line that
    names it: ours get the path in front (unless they name it already), and the readers' own
    errors on a damaged file become ModelLoadErrors, so `generate` and `serve` print one line."""
    try:
        yield
    except RidgefillError as e:
        if source in str(e):
            raise
        raise type(e)(f"{source}: {e}") from e
    except _FILE_CONTENT_ERRORS as e:
        raise ModelLoadError(f"{source}: cannot read the model ({type(e).__name__}: {e})") from e
