"""Qwen3: the Llama decoder plus QK-norm (per-head RMSNorm on queries and keys before RoPE)."""

from __future__ import annotations

from . import decoder_config
from .dense import DenseLM
from .family import GGUFFormat, ModelFamily
from .weights import DENSE_SHARDS

QWEN3 = ModelFamily(
    name="qwen3",
    model_class=DenseLM,
    parse_hf_config=decoder_config.config_from_hf,
    weight_names=decoder_config.weight_names,
    packed_weights=True,
    shards=DENSE_SHARDS,
    qk_norm=True,
    gguf=GGUFFormat(
        architecture="qwen3",
        parse_config=decoder_config.config_from_gguf,
        top_level_names=decoder_config.GGUF_TOP_LEVEL_NAMES,
        layer_part_names={**decoder_config.GGUF_LAYER_PART_NAMES, **decoder_config.GGUF_QK_NORM_PART_NAMES},
        interleaved_rope_rows=False,  # llama.cpp writes Qwen3's q/k rows in Hugging Face order
    ),
)
