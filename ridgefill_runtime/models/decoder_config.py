"""The dense decoder families' shared parts (Llama, Qwen3): config.json and GGUF metadata ->
ModelConfig, the Hugging Face weight names, and llama.cpp's tensor names.

What differs between the families is read from the family (`family.qk_norm`, its GGUF names);
the file formats themselves are read by loader/hf.py and loader/gguf.py.
"""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig, RopeScaling
from ..errors import ModelLoadError, UnsupportedError
from .family import MetadataLookup, ModelFamily

# -- Hugging Face config.json ------------------------------------------------------------------


def config_from_hf(family: ModelFamily, raw: dict, generation: dict, where: str) -> ModelConfig:
    """Map a transformers config.json (v4 or v5 layout) onto ModelConfig, refusing what we lack."""
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedError(f"{where}: unsupported hidden_act {raw['hidden_act']!r}")
    if raw.get("mlp_bias"):
        raise UnsupportedError(f"{where}: mlp_bias=true is not supported")
    if raw.get("use_sliding_window"):
        raise UnsupportedError(f"{where}: use_sliding_window=true is not supported")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta, scaling = _hf_rope(raw, where)
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        return ModelConfig(
            architecture=family.name,
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
            qk_norm=family.qk_norm,
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=as_id_tuple(eos),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing key {e.args[0]!r}") from None


def _hf_rope(raw: dict, where: str) -> tuple[float, RopeScaling | None]:
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


def as_id_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(int(i) for i in x) if isinstance(x, (list, tuple)) else (int(x),)


# -- Weight names ------------------------------------------------------------------------------

_LAYER_PARTS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_QK_NORM_PARTS = ("self_attn.q_norm", "self_attn.k_norm")


def weight_names(config: ModelConfig) -> list[str]:
    """The Hugging Face weight names a complete checkpoint of `config` holds (biases aside)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    parts = _LAYER_PARTS + (_QK_NORM_PARTS if config.qk_norm else ())
    return names + [f"model.layers.{i}.{part}.weight" for i in range(config.num_layers) for part in parts]


# llama.cpp's tensor names -> Hugging Face names, shared by the dense families.
GGUF_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_PART_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_QK_NORM_PART_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


# -- GGUF metadata -----------------------------------------------------------------------------


def config_from_gguf(
    family: ModelFamily, metadata: MetadataLookup, tensors: dict, tokenizer, rope_freqs: torch.Tensor | None
) -> ModelConfig:
    """ModelConfig from a GGUF file's `{architecture}.*` metadata and its tensors (by GGUF name)."""
    prefix = family.gguf.architecture

    def get(key: str, default=None):
        return metadata(f"{prefix}.{key}", default)

    def require(key: str):
        value = get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {prefix}.{key}")
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
            f"GGUF tokenizer has {tokenizer.vocab_size} tokens but the embedding only {vocab_size} rows"
        )

    return ModelConfig(
        architecture=family.name,
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
        qk_norm=family.qk_norm,
        rope_scaling=_gguf_rope_scaling(get, head_dim, theta, rope_freqs),
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def _gguf_rope_scaling(get, head_dim: int, theta: float, rope_freqs: torch.Tensor | None) -> RopeScaling | None:
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
    candidate = RopeScaling(
        factor=float(rope_freqs.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=original,
    )
    expected = llama3_frequency_divisors(candidate, head_dim, theta)
    if rope_freqs.shape != expected.shape or not torch.allclose(rope_freqs.double(), expected, rtol=1e-4):
        raise UnsupportedError("GGUF rope_freqs.weight does not match llama3 scaling; not supported")
    return candidate
