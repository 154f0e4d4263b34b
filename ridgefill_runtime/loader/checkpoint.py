"""What a loader hands to the model: config, weights by Hugging Face name, tokenizer, identity."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping

import torch

from ..config import ModelConfig, RopeScaling
from ..errors import ModelLoadError
from ..models.registry import family
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
    """The inverse of `model_config_to_dict`; the architecture's family (models/registry.py) says
    which class its `family_config` dict is, and refuses an architecture it does not know."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = set(data) - names
    if unknown:
        raise ModelLoadError(f"model config has unknown keys {sorted(unknown)}")
    values = dict(data)
    if values.get("rope_scaling") is not None:
        values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
    values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
    owner = family(values.get("architecture"))
    values["family_config"] = _dataclass_from_dict(owner.config_class, values.get("family_config") or {})
    return owner.checked(ModelConfig(**values), "model config")


def _dataclass_from_dict(cls: type, data: Mapping[str, Any]):
    """`cls(**data)`, with the dicts that asdict made of its dataclass fields (HybridConfig.moe) made
    into those dataclasses again, and JSON's lists into the tuples the frozen classes hold."""
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        kind = _dataclass_in(hints.get(name))
        if isinstance(value, Mapping) and kind is not None:
            value = _dataclass_from_dict(kind, value)
        elif isinstance(value, list):
            value = tuple(value)
        values[name] = value
    try:
        return cls(**values)
    except TypeError as e:  # a field it does not have, or one missing
        raise ModelLoadError(f"model config: {cls.__name__}: {e}") from None


def _dataclass_in(hint) -> type | None:
    """The dataclass a field's annotation names (`MoEConfig | None` -> MoEConfig), or None."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None
