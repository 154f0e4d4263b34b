"""Hugging Face checkpoint folders: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..config import ModelConfig, RopeScaling
from ..errors import ModelLoadError, UnsupportedError
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
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer,
                      identity=weights_identity(files), source=str(folder))


def config_from_hf(raw: dict, generation: dict, where: str = "config.json") -> ModelConfig:
    """Map a transformers config.json (v4 or v5 layout) onto ModelConfig, refusing what we lack."""
    arch = raw.get("model_type")
    if arch not in ("llama", "qwen3"):
        raise UnsupportedError(f"{where}: unsupported architecture model_type={arch!r} (supported: llama, qwen3)")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(f"{where}: unsupported hidden_act {raw['hidden_act']!r}")
    if raw.get("mlp_bias"):
        raise UnsupportedError(f"{where}: mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise UnsupportedError(f"{where}: use_sliding_window=true is not supported")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta, scaling = _rope(raw, where)
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=arch == "qwen3",
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=_as_tuple(eos),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing key {e.args[0]!r}") from None


def _rope(raw: dict, where: str) -> tuple[float, RopeScaling | None]:
    # NOTE: transformers v5 nests theta and scaling in `rope_parameters`; v4 has
    # top-level `rope_theta` and an optional `rope_scaling` dict.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or params
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UnsupportedError(f"{where}: unsupported rope scaling type {kind!r} (supported: llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(i) for i in x) if isinstance(x, (list, tuple)) else (int(x),)


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
