"""Huginn-named tensors -> the looped model's typed weights (one SandwichBlock per layer index)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..config import ModelConfig
from .weights import _Fetcher

BLOCK_PARTS = (
    "norm_1.weight",
    "attn.Wqkv.weight",
    "attn.proj.weight",
    "norm_2.weight",
    "mlp.fc.weight",
    "mlp.proj.weight",
    "norm_3.weight",
    "norm_4.weight",
)


# Tensor parallelism (parallel/shard.py): the fused Wqkv by head, fc's gate and up halves by MLP
# column, proj (attention) and mlp.proj by input, summed over the ranks (LoopedLM.sum_shards).
# The embedding and head by token (layers/vocab.py); the adapter and norms: whole.
LOOPED_SHARDS = MappingProxyType(
    {
        "attn.Wqkv.weight": "qkv_heads",
        "attn.qk_bias": "qk_bias_heads",
        "attn.proj.weight": "q_columns",
        "mlp.fc.weight": "gate_up_rows",
        "mlp.proj.weight": "mlp_columns",
        "transformer.wte.weight": "vocab_rows",
        "lm_head.weight": "vocab_rows",
    }
)


@dataclass
class SandwichWeights:
    """x = norm_2(attn(norm_1(x)) + x); x = norm_4(mlp(norm_3(x)) + x)."""

    norm_1: torch.Tensor  # [d]
    qkv: torch.Tensor  # [(H + 2 Hkv) D, d]: q rows, k rows, v rows
    q_bias: torch.Tensor | None  # [H, D], added before the rotary
    k_bias: torch.Tensor | None  # [Hkv, D]
    proj: torch.Tensor  # [d, H D]
    norm_2: torch.Tensor
    gate_up: torch.Tensor  # [2I, d]: gate rows, then up rows (Huginn's fused `fc`)
    down: torch.Tensor  # [d, I]
    norm_3: torch.Tensor
    norm_4: torch.Tensor


@dataclass
class LoopedWeights:
    embed: torch.Tensor  # [V, d]
    blocks: list[SandwichWeights]  # by layer index: prelude, core, coda
    adapter: torch.Tensor  # [d, 2d] over [state, embedded input]
    adapter_bias: torch.Tensor | None  # [d]
    final_norm: torch.Tensor  # [d] ln_f, applied after the last loop and again after the coda
    lm_head: torch.Tensor  # [V, d] (the embedding itself when tied)


def block_prefix(config: ModelConfig, layer: int) -> str:
    """transformer.prelude.{i}. / transformer.core_block.{i}. / transformer.coda.{i}. of layer index `layer`."""
    lc = config.family_config
    if layer < lc.prelude:
        return f"transformer.prelude.{layer}."
    if layer < lc.prelude + lc.core:
        return f"transformer.core_block.{layer - lc.prelude}."
    return f"transformer.coda.{layer - lc.prelude - lc.core}."


def build_looped_weights(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device
) -> LoopedWeights:
    f = _Fetcher(tensors, dtype, device)
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
    blocks = []
    for layer in range(cfg.num_layers):
        p = block_prefix(cfg, layer)
        q_bias = k_bias = None
        if cfg.family_config.qk_bias:
            q_bias, k_bias = f.get(p + "attn.qk_bias", (2, 1, heads, hd))[:, 0].unbind(0)  # [H, D] each
        blocks.append(
            SandwichWeights(
                norm_1=f.get(p + "norm_1.weight", (d,)),
                qkv=f.get(p + "attn.Wqkv.weight", ((heads + 2 * kv_heads) * hd, d)),
                q_bias=q_bias,
                k_bias=k_bias,
                proj=f.get(p + "attn.proj.weight", (d, heads * hd)),
                norm_2=f.get(p + "norm_2.weight", (d,)),
                gate_up=f.get(p + "mlp.fc.weight", (2 * inter, d)),
                down=f.get(p + "mlp.proj.weight", (d, inter)),
                norm_3=f.get(p + "norm_3.weight", (d,)),
                norm_4=f.get(p + "norm_4.weight", (d,)),
            )
        )
    embed = f.get("transformer.wte.weight", (cfg.held_vocab, d))
    lm_head = embed if cfg.tie_word_embeddings else f.get("lm_head.weight", (cfg.held_vocab, d))
    return LoopedWeights(
        embed=embed,
        blocks=blocks,
        adapter=f.get("transformer.adapter.weight", (d, 2 * d)),
        adapter_bias=f.get("transformer.adapter.bias", (d,)) if cfg.family_config.adapter_bias else None,
        final_norm=f.get("transformer.ln_f.weight", (d,)),
        lm_head=lm_head,
    )
