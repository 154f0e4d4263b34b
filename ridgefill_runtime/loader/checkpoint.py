"""What a loader hands to the model: config, weights by Hugging Face name, tokenizer, identity."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import torch

from ..config import HybridConfig, LoopedConfig, ModelConfig, MoEConfig, RopeScaling, SlidingWindow
from ..errors import ModelLoadError
from .tokenizer import Tokenizer


@dataclass
class Checkpoint:
    config: ModelConfig
    # Hugging Face parameter names: model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight,
    # ...k_proj/v_proj/o_proj, mlp.gate_proj/up_proj/down_proj, input_layernorm,
    # post_attention_layernorm, self_attn.q_norm/k_norm (qwen3), model.norm.weight, and
    # lm_head.weight unless the embeddings are tied.
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    identity: str  # hex sha256 identifying the weights
    source: str  # the path it came from


def model_config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """A JSON-ready dict; `model_config_from_dict` inverts it exactly."""
    data = dataclasses.asdict(config)
    data["eos_token_ids"] = list(config.eos_token_ids)
    return data


def model_config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(data) - names
    if unknown:
        raise ModelLoadError(f"model config has unknown keys {sorted(unknown)}")
    values = dict(data)
    if values.get("rope_scaling") is not None:
        values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
    if values.get("hybrid") is not None:
        hybrid = dict(values["hybrid"])
        hybrid["moe"] = None if hybrid.get("moe") is None else MoEConfig(**hybrid["moe"])
        values["hybrid"] = HybridConfig(**hybrid)
    if values.get("looped") is not None:
        values["looped"] = LoopedConfig(**values["looped"])
    if values.get("sliding") is not None:
        values["sliding"] = SlidingWindow(**values["sliding"])
    return ModelConfig(**values)
