"""The hybrid families' own settings (HybridConfig, MoEConfig) and their config.json -> ModelConfig.

The attention-side fields parse as for the dense families (decoder_config.config_from_hf); the
GDN geometry, the layer pattern, the partial rotary and the MoE settings are added here. A
Qwen3.5 vision-language checkpoint (model_type "qwen3_5") keeps the text model's settings
under `text_config`; only its text path is served.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import FamilyConfig, ModelConfig
from ..errors import ModelLoadError
from . import decoder_config
from .family import ModelFamily

LAYER_KINDS = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLP (Qwen3-Next): per token, the top `top_k` of `num_experts` routed
    experts (router softmax, renormalised over the chosen when `norm_topk_prob`) plus a shared
    expert scaled by sigmoid(its gate). Layers (i + 1) % sparse_step == 0 that are not in
    `mlp_only_layers` use it; the others keep the dense MLP."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool = True
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name in ("num_experts", "top_k", "expert_intermediate_size", "shared_intermediate_size", "sparse_step"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: moe.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ModelLoadError(f"model config: moe.top_k {self.top_k} exceeds num_experts {self.num_experts}")

    def sparse_at(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class HybridConfig(FamilyConfig):
    """Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): which layers attend, the linear-attention
    (GDN) geometry, and the attention layers' partial rotary. Seed 000 §2.3."""

    layer_types: tuple[str, ...]  # per layer: "full_attention" | "linear_attention"
    conv_kernel: int  # depthwise causal conv width over q, k, v
    key_heads: int
    value_heads: int  # a multiple of key_heads
    key_head_dim: int
    value_head_dim: int
    partial_rotary_factor: float = 0.25  # share of each attention head's dims that rotate
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        bad = [t for t in self.layer_types if t not in LAYER_KINDS]
        if bad:
            raise ModelLoadError(f"model config: unknown layer type {bad[0]!r} (known: {', '.join(LAYER_KINDS)})")
        for name in ("conv_kernel", "key_heads", "value_heads", "key_head_dim", "value_head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.value_heads % self.key_heads:
            raise ModelLoadError(
                f"model config: linear value heads {self.value_heads} are not a multiple of key heads {self.key_heads}"
            )
        if not 0 < self.partial_rotary_factor <= 1:
            raise ModelLoadError(
                f"model config: partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )

    def check(self, config: ModelConfig) -> None:
        if len(self.layer_types) != config.num_layers:
            raise ModelLoadError(f"model config: {len(self.layer_types)} layer types for {config.num_layers} layers")

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    def shard_counts(self) -> dict[str, int]:
        """Tensor parallelism splits the GDN heads (value heads go with their key head: value head
        j reads key head j // (Hv / Hk), so a rank keeping key heads a..b keeps value heads
        a·r..b·r, r = Hv / Hk) and each expert's MLP width (within experts: see parallel/shard.py)."""
        counts = {"key_heads": self.key_heads, "value_heads": self.value_heads}
        if self.moe is not None:
            counts.update(expert_mlp=self.moe.expert_intermediate_size, shared_mlp=self.moe.shared_intermediate_size)
        return counts

    def sharded(self, size: int) -> HybridConfig:
        moe = self.moe and dataclasses.replace(
            self.moe,
            expert_intermediate_size=self.moe.expert_intermediate_size // size,
            shared_intermediate_size=self.moe.shared_intermediate_size // size,
        )
        return dataclasses.replace(
            self, key_heads=self.key_heads // size, value_heads=self.value_heads // size, moe=moe
        )

    @property
    def conv_channels(self) -> int:
        """q, k and v go through one depthwise conv: 2 * key dims + value dims."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim


def config_from_hf(family: ModelFamily, raw: dict, generation: dict, where: str) -> ModelConfig:
    text = dict(raw.get("text_config") or raw)
    if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    base = decoder_config.config_from_hf(family, text, generation, where)
    try:
        hybrid = HybridConfig(
            layer_types=_layer_types(text, base.num_layers),
            conv_kernel=int(text["linear_conv_kernel_dim"]),
            key_heads=int(text["linear_num_key_heads"]),
            value_heads=int(text["linear_num_value_heads"]),
            key_head_dim=int(text["linear_key_head_dim"]),
            value_head_dim=int(text["linear_value_head_dim"]),
            partial_rotary_factor=_partial_rotary(text),
            moe=_moe(text),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing key {e.args[0]!r}") from None
    except ModelLoadError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    return base.replace(family_config=hybrid)


def _layer_types(text: dict, num_layers: int) -> tuple[str, ...]:
    """Explicit `layer_types`, or every `full_attention_interval`-th layer attends (default 4)."""
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    interval = int(text.get("full_attention_interval", 4))
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))


def _partial_rotary(text: dict) -> float:
    params = text.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))


def _moe(text: dict) -> MoEConfig | None:
    if int(text.get("num_experts") or 0) == 0:
        return None
    return MoEConfig(
        num_experts=int(text["num_experts"]),
        top_k=int(text["num_experts_per_tok"]),
        expert_intermediate_size=int(text["moe_intermediate_size"]),
        shared_intermediate_size=int(text["shared_expert_intermediate_size"]),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        sparse_step=int(text.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in text.get("mlp_only_layers") or ()),
    )
