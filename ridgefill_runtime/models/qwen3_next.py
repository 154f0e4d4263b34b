"""Qwen3-Next: the Gated DeltaNet hybrid with fused GDN projections (in_proj_qkvz, in_proj_ba) and
mixture-of-experts MLPs (routed top-k experts plus a gated shared expert)."""

from __future__ import annotations

from . import hybrid_config
from .family import ModelFamily
from .hybrid import HybridLM
from .hybrid_weights import HYBRID_SHARDS, hybrid_weight_names

QWEN3_NEXT = ModelFamily(
    name="qwen3_next",
    model_class=HybridLM,
    parse_hf_config=hybrid_config.config_from_hf,
    weight_names=lambda cfg: hybrid_weight_names(cfg, fused_gdn=True),
    config_class=hybrid_config.HybridConfig,
    qk_norm=True,
    shards=HYBRID_SHARDS,
)
