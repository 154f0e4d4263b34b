"""Hugging Face checkpoint folders: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..models.registry import family_for_model_type
from .checkpoint import Checkpoint

_SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_hf_folder(folder: str | os.PathLike) -> Checkpoint:
    folder = Path(folder)
    raw = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json") if (folder / "generation_config.json").exists() else {}
    config = config_from_hf(raw, generation, where=str(folder / "config.json"))
    files = _weight_files(folder)
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(_load_safetensors(f))
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_folder(folder)
    return Checkpoint(
        config=config, tensors=tensors, tokenizer=tokenizer, identity=weights_identity(files), source=str(folder)
    )


def config_from_hf(raw: dict, generation: dict, where: str = "config.json") -> ModelConfig:
    """The model family named by `model_type` (models/registry.py) parses the rest."""
    family = family_for_model_type(raw.get("model_type"), where)
    return family.config_from_hf(raw, generation, where)


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise ModelLoadError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / _SAFETENSORS_INDEX
    if index.exists():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not names:
            raise ModelLoadError(f"{index}: weight_map is empty")
        files = [folder / n for n in names]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f}: safetensors shard named in {index.name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    return files


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({type(e).__name__}: {e})") from None


def weights_identity(files: list[Path], samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A cheap fingerprint of the weights: each file's size, header and 16 spread-out samples.

    NOTE: hashing every byte of a multi-GB checkpoint would cost tens of seconds per start;
    the header pins names/shapes/dtypes and the samples tell fine-tunes of one shape apart.
    """
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(header_len, 1 << 24)))
            for j in range(samples):
                fh.seek(size * j // samples)
                h.update(fh.read(sample_bytes))
    return h.hexdigest()
