"""The hybrid families' config.json -> ModelConfig (with its HybridConfig).

The attention-side fields parse as for the dense families (decoder_config.config_from_hf); the
GDN geometry, the layer pattern, the partial rotary and the MoE settings are added here. A
Qwen3.5 vision-language checkpoint (model_type "qwen3_5") keeps the text model's settings
under `text_config`; only its text path is served.
"""

from __future__ import annotations

from ..config import HybridConfig, ModelConfig, MoEConfig
from ..errors import ModelLoadError
from . import decoder_config
from .family import ModelFamily


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
    return base.replace(hybrid=hybrid)


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
