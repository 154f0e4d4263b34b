"""Qwen2 (and Qwen2.5, Qwen2.5-Coder): the Llama decoder with biases on q, k and v (none on o).

Hugging Face's Qwen2 config has no `attention_bias` key: the biases are part of the
architecture, so the family sets them. llama.cpp writes Qwen2's q/k rows in Hugging Face order
(its NEOX rotary layout), so the loader permutes nothing. The vocabulary is padded (151,936 rows
for 151,665 tokens); the tokenizer decodes the rows no token spells to nothing.
"""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from . import decoder_config
from .dense import DenseLM
from .family import GGUFFormat, ModelFamily
from .weights import DENSE_SHARDS


def config_from_hf(family: ModelFamily, raw: dict, generation: dict, where: str) -> ModelConfig:
    config = decoder_config.config_from_hf(family, raw, generation, where)
    return dataclasses.replace(config, attention_bias=True)


QWEN2 = ModelFamily(
    name="qwen2",
    model_class=DenseLM,
    parse_hf_config=config_from_hf,
    weight_names=decoder_config.weight_names,
    packed_weights=True,
    shards=DENSE_SHARDS,
    gguf=GGUFFormat(
        architecture="qwen2",
        parse_config=decoder_config.config_from_gguf,
        top_level_names=decoder_config.GGUF_TOP_LEVEL_NAMES,
        layer_part_names=decoder_config.GGUF_LAYER_PART_NAMES,
        interleaved_rope_rows=False,
    ),
)
