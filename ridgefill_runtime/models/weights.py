"""Turn a Hugging Face-named state dict into the dense model's fused, typed weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ModelLoadError


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: torch.Tensor  # [(H + 2*Hkv) * D, d]: q rows, then k rows, then v rows
    qkv_bias: torch.Tensor | None  # [(H + 2*Hkv) * D]
    o: torch.Tensor  # [d, H*D]
    q_norm: torch.Tensor | None  # [D] (Qwen3 QK-norm)
    k_norm: torch.Tensor | None  # [D]
    post_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [2I, d]: gate rows, then up rows
    down: torch.Tensor  # [d, I]


@dataclass
class DenseWeights:
    embed: torch.Tensor  # [V, d]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [d]
    lm_head: torch.Tensor  # [V, d] (the embedding itself when tied)


class _Fetcher:
    """Takes tensors by name, checking presence and shape, casting to the run dtype."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device):
        self.tensors, self.dtype, self.device = tensors, dtype, device

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        t = self.tensors[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(device=self.device, dtype=self.dtype)


def build_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                  device) -> DenseWeights:
    f = _Fetcher(tensors, dtype, device)
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([f.get(p + "self_attn.q_proj.weight", (q_out, d)),
                         f.get(p + "self_attn.k_proj.weight", (kv_out, d)),
                         f.get(p + "self_attn.v_proj.weight", (kv_out, d))])
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([f.get(p + "self_attn.q_proj.bias", (q_out,)),
                              f.get(p + "self_attn.k_proj.bias", (kv_out,)),
                              f.get(p + "self_attn.v_proj.bias", (kv_out,))])
        layers.append(LayerWeights(
            input_norm=f.get(p + "input_layernorm.weight", (d,)),
            qkv=qkv.contiguous(),
            qkv_bias=bias,
            o=f.get(p + "self_attn.o_proj.weight", (d, q_out)),
            q_norm=f.get(p + "self_attn.q_norm.weight", (hd,)) if cfg.qk_norm else None,
            k_norm=f.get(p + "self_attn.k_norm.weight", (hd,)) if cfg.qk_norm else None,
            post_norm=f.get(p + "post_attention_layernorm.weight", (d,)),
            gate_up=torch.cat([f.get(p + "mlp.gate_proj.weight", (inter, d)),
                               f.get(p + "mlp.up_proj.weight", (inter, d))]).contiguous(),
            down=f.get(p + "mlp.down_proj.weight", (d, inter)),
        ))
    embed = f.get("model.embed_tokens.weight", (cfg.vocab_size, d))
    if cfg.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = f.get("lm_head.weight", (cfg.vocab_size, d))
    return DenseWeights(embed=embed, layers=layers,
                        final_norm=f.get("model.norm.weight", (d,)), lm_head=lm_head)
