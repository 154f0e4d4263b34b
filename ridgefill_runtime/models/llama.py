"""Llama: the dense decoder (GQA, RoPE with optional llama3 scaling, SwiGLU), no QK-norm."""

from __future__ import annotations

from . import decoder_config
from .dense import DenseLM
from .family import GGUFFormat, ModelFamily
from .weights import DENSE_SHARDS

LLAMA = ModelFamily(
    name="llama",
    model_class=DenseLM,
    parse_hf_config=decoder_config.config_from_hf,
    weight_names=decoder_config.weight_names,
    packed_weights=True,
    shards=DENSE_SHARDS,
    gguf=GGUFFormat(
        architecture="llama",
        parse_config=decoder_config.config_from_gguf,
        top_level_names=decoder_config.GGUF_TOP_LEVEL_NAMES,
        layer_part_names=decoder_config.GGUF_LAYER_PART_NAMES,
        # NOTE: llama.cpp's converter permutes llama q/k rows for its interleaved RoPE.
        interleaved_rope_rows=True,
    ),
)
