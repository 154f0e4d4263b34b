"""Qwen3.5 (dense hybrid: 3 Gated DeltaNet layers to 1 gated attention layer): `qwen3_5_text`
checkpoints, and the text path of `qwen3_5` vision-language checkpoints."""

from __future__ import annotations

from . import hybrid_config
from .family import ModelFamily
from .hybrid import HybridLM
from .hybrid_weights import HYBRID_SHARDS, hybrid_weight_names

QWEN3_5_TEXT = ModelFamily(
    name="qwen3_5_text",
    model_class=HybridLM,
    parse_hf_config=hybrid_config.config_from_hf,
    weight_names=lambda cfg: hybrid_weight_names(cfg, fused_gdn=False),
    config_class=hybrid_config.HybridConfig,
    qk_norm=True,
    shards=HYBRID_SHARDS,
)
QWEN3_5 = ModelFamily(
    name="qwen3_5",
    model_class=HybridLM,
    parse_hf_config=hybrid_config.config_from_hf,
    weight_names=lambda cfg: hybrid_weight_names(cfg, fused_gdn=False),
    config_class=hybrid_config.HybridConfig,
    qk_norm=True,
    shards=HYBRID_SHARDS,
)
