"""What one model family is: its name, how its configs parse, its model class, its weight names.

A family is plain data; `registry.py` holds the one table of families the runtime supports.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..config import FamilyConfig, ModelConfig
from ..errors import ModelLoadError

# GGUF metadata lookup: full key (e.g. "llama.block_count") and a default -> the value.
MetadataLookup = Callable[[str, Any], Any]
# (family, config.json dict, generation_config.json dict, where) -> ModelConfig
HFConfigParser = Callable[["ModelFamily", dict, dict, str], ModelConfig]
# (family, metadata lookup, GGUF tensors by name, tokenizer, rope_freqs tensor or None) -> ModelConfig
GGUFConfigParser = Callable[["ModelFamily", MetadataLookup, dict, Any, Any], ModelConfig]

# llama.cpp names a layer's tensors blk.{i}.{part}.{weight|bias}, whatever the family.
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFFormat:
    """How llama.cpp's converter writes a family: the architecture name and the tensor names."""

    architecture: str  # general.architecture, also the prefix of its metadata keys
    parse_config: GGUFConfigParser
    top_level_names: Mapping[str, str]  # GGUF tensor name -> Hugging Face name
    layer_part_names: Mapping[str, str]  # blk.{i}.<part> -> model.layers.{i}.<HF part>
    # llama.cpp's converter interleaves the rotary halves of q/k rows for some families (llama);
    # the loader undoes it.
    interleaved_rope_rows: bool = False
    # llama.cpp's converter adds this to every norm weight of some families (Gemma: 1, for their
    # (1 + w) norms); the loader subtracts it so the tensors are Hugging Face's.
    norm_offset: float = 0.0

    def __post_init__(self) -> None:
        if not self.architecture:
            raise ValueError("GGUFFormat.architecture must not be empty")
        if not callable(self.parse_config):
            raise ValueError(f"GGUFFormat({self.architecture!r}).parse_config must be callable")
        # NOTE: read-only views, so one family cannot change another's shared table.
        object.__setattr__(self, "top_level_names", MappingProxyType(dict(self.top_level_names)))
        object.__setattr__(self, "layer_part_names", MappingProxyType(dict(self.layer_part_names)))

    def hf_name(self, gguf_name: str) -> str | None:
        """The Hugging Face parameter name of a GGUF tensor; None when the family has no place for it."""
        if gguf_name in self.top_level_names:
            return self.top_level_names[gguf_name]
        match = _LAYER_TENSOR.fullmatch(gguf_name)
        if match is None or match.group(2) not in self.layer_part_names:
            return None
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{self.layer_part_names[part]}.{kind}"


@dataclass(frozen=True)
class ModelFamily:
    """One supported architecture.

    name: the Hugging Face `model_type`, and `ModelConfig.architecture` of its models.
    model_class: called as model_class(config, tensors, dtype=..., device=...) with tensors by
      Hugging Face name (see loader/checkpoint.py).
    parse_hf_config: config.json (+ generation_config.json) -> ModelConfig.
    weight_names: the Hugging Face tensor names a complete checkpoint of `config` holds.
    config_class: the type of its configs' `family_config`, its own settings (a FamilyConfig
      subclass defined beside the family; FamilyConfig itself when it has none).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    gguf: how its GGUF files are written; None when GGUF files of this family are not read.
    """

    name: str
    model_class: Callable[..., Any]
    parse_hf_config: HFConfigParser
    weight_names: Callable[[ModelConfig], list[str]]
    config_class: type[FamilyConfig] = FamilyConfig
    qk_norm: bool = False
    gguf: GGUFFormat | None = None
    # its model class takes a GGUF's quantized linear weights packed (GroupedInts; ops/packed_linear)
    packed_weights: bool = False
    # tensor parallelism: how each weight is cut, by the end of its name -> a rule of
    # parallel/shard.py ("q_heads", "o_columns", ...); names matching none stay whole on every
    # rank. None: the family is not sharded (its model adds no partial sums across ranks).
    shards: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ModelFamily.name must not be empty")
        for field_name in ("model_class", "parse_hf_config", "weight_names"):
            if not callable(getattr(self, field_name)):
                raise ValueError(f"ModelFamily({self.name!r}).{field_name} must be callable")
        if not (isinstance(self.config_class, type) and issubclass(self.config_class, FamilyConfig)):
            raise ValueError(f"ModelFamily({self.name!r}).config_class must be a FamilyConfig subclass")

    def config_from_hf(self, raw: dict, generation: dict, where: str) -> ModelConfig:
        return self.checked(self.parse_hf_config(self, raw, generation, where), where)

    def config_from_gguf(self, metadata: MetadataLookup, tensors: dict, tokenizer, rope_freqs) -> ModelConfig:
        if self.gguf is None:
            raise ValueError(f"model family {self.name!r} has no GGUF format")
        config = self.gguf.parse_config(self, metadata, tensors, tokenizer, rope_freqs)
        return self.checked(config, f"GGUF ({self.gguf.architecture})")

    def build_model(self, config: ModelConfig, tensors: dict, dtype, device):
        return self.model_class(self.checked(config, "model config"), tensors, dtype=dtype, device=device)

    def checked(self, config: ModelConfig, where: str) -> ModelConfig:
        """`config`, refused unless it is one of this family's: its architecture and its own settings.
        NOTE: ModelConfig cannot check these itself: it knows no family (config.py imports no model)."""
        if config.architecture != self.name:
            raise ModelLoadError(f"{where}: architecture {config.architecture!r} is not {self.name!r}")
        if not isinstance(config.family_config, self.config_class):
            raise ModelLoadError(
                f"{where}: a {self.name} config needs a {self.config_class.__name__} family_config, "
                f"got {type(config.family_config).__name__}"
            )
        return config
