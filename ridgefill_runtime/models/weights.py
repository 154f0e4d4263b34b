"""Turn a Hugging Face-named state dict into the dense model's fused, typed weights.

A linear weight may arrive as GroupedInts (the loader's packed GGUF blocks, when the engine runs
`weights = "packed"`): it stays packed (ops/packed_linear.PackedWeight) and fused parts are joined
without changing a value; norms and biases are always dense in the run dtype."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..ops.grouped_ints import GroupedInts, concat_rows, dequantize_groups
from ..ops.packed_linear import PackedWeight, pack

Weight = torch.Tensor | PackedWeight  # a linear layer's weight

# Tensor parallelism (parallel/shard.py): Megatron's cut of the Llama-named layer weights. q/k/v
# (and their biases) by head, gate/up by MLP column; o and down by input, their products summed
# over the ranks (DenseLM.sum_shards). Embedding and head by token (layers/vocab.py). Norms: whole.
DENSE_SHARDS = MappingProxyType(
    {
        "self_attn.q_proj.weight": "q_heads",
        "self_attn.q_proj.bias": "q_heads",
        "self_attn.k_proj.weight": "kv_heads",
        "self_attn.k_proj.bias": "kv_heads",
        "self_attn.v_proj.weight": "kv_heads",
        "self_attn.v_proj.bias": "kv_heads",
        "mlp.gate_proj.weight": "mlp_rows",
        "mlp.up_proj.weight": "mlp_rows",
        "self_attn.o_proj.weight": "q_columns",
        "mlp.down_proj.weight": "mlp_columns",
        "embed_tokens.weight": "vocab_rows",
        "lm_head.weight": "vocab_rows",
    }
)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [d]
    qkv: Weight  # [(H + 2*Hkv) * D, d]: q rows, then k rows, then v rows
    qkv_bias: torch.Tensor | None  # [(H + 2*Hkv) * D]
    o: Weight  # [d, H*D]
    q_norm: torch.Tensor | None  # [D] (Qwen3 QK-norm)
    k_norm: torch.Tensor | None  # [D]
    post_norm: torch.Tensor  # [d]
    gate_up: Weight  # [2I, d]: gate rows, then up rows
    down: Weight  # [d, I]


@dataclass
class DenseWeights:
    embed: Weight  # [V, d]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [d]
    lm_head: Weight  # [V, d] (the embedding itself when tied)


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
        self._check(name, t, shape)
        if isinstance(t, GroupedInts):  # NOTE: a packed tensor where a dense one is needed
            return dequantize_groups(t).to(device=self.device, dtype=self.dtype)
        return t.to(device=self.device, dtype=self.dtype)

    def linear(self, names: list[str], shapes: list[tuple[int, int]]) -> Weight:
        """Row-wise join of linear weights: packed when every part arrived packed."""
        parts = [self.tensors.get(name) for name in names]
        if parts and all(isinstance(p, GroupedInts) for p in parts):
            for name, part, shape in zip(names, parts, shapes):
                self._check(name, part, shape)
            g = concat_rows(parts)
            return pack(g.q, g.scale, g.min, g.bits, g.group).to(self.device)
        tensors = [self.get(name, shape) for name, shape in zip(names, shapes)]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors).contiguous()

    def _check(self, name: str, t, shape: tuple[int, ...]) -> None:
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")


def build_weights(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device) -> DenseWeights:
    f = _Fetcher(tensors, dtype, device)
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv = f.linear(
            [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"],
            [(q_out, d), (kv_out, d), (kv_out, d)],
        )
        bias = None
        if cfg.attention_bias:
            bias = torch.cat(
                [
                    f.get(p + "self_attn.q_proj.bias", (q_out,)),
                    f.get(p + "self_attn.k_proj.bias", (kv_out,)),
                    f.get(p + "self_attn.v_proj.bias", (kv_out,)),
                ]
            )
        layers.append(
            LayerWeights(
                input_norm=f.get(p + "input_layernorm.weight", (d,)),
                qkv=qkv,
                qkv_bias=bias,
                o=f.linear([p + "self_attn.o_proj.weight"], [(d, q_out)]),
                q_norm=f.get(p + "self_attn.q_norm.weight", (hd,)) if cfg.qk_norm else None,
                k_norm=f.get(p + "self_attn.k_norm.weight", (hd,)) if cfg.qk_norm else None,
                post_norm=f.get(p + "post_attention_layernorm.weight", (d,)),
                gate_up=f.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(inter, d), (inter, d)]),
                down=f.linear([p + "mlp.down_proj.weight"], [(d, inter)]),
            )
        )
    # NOTE: a tied table is packed (it is the head, read whole every step); an untied one only
    # serves lookups, so it is dense and the head alone is packed.
    if cfg.tie_word_embeddings:
        embed = lm_head = f.linear(["model.embed_tokens.weight"], [(cfg.held_vocab, d)])
    else:
        embed = f.get("model.embed_tokens.weight", (cfg.held_vocab, d))
        lm_head = f.linear(["lm_head.weight"], [(cfg.held_vocab, d)])
    return DenseWeights(embed=embed, layers=layers, final_norm=f.get("model.norm.weight", (d,)), lm_head=lm_head)
