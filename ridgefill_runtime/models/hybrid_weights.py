"""Hugging Face tensors -> the hybrid model's typed weights (Qwen3.5 and Qwen3-Next layouts).

Both families end in one layout: per GDN layer one input projection [q | k | v | b | a | z]
(Qwen3.5 stores the four parts apart; Qwen3-Next fuses q, k, v, z and b, a per key-head group,
which is regrouped here), per attention layer one [q+gate | k | v] projection, and norm weights
kept as float32 (1 + w) where the family's RMSNorm is zero-centred.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..config import ModelConfig
from .hybrid_config import HybridConfig
from ..layers.gated_deltanet import GDNWeights
from ..layers.moe import MoEWeights
from .weights import _Fetcher


# Tensor parallelism (parallel/shard.py): the rule cutting each weight, by the end of its name (`*`:
# an expert's index). Column-parallel by head or MLP column; out_proj, o_proj and down by input,
# summed over the ranks (HybridLM.sum_shards); embedding and head by token (layers/vocab.py). Norms,
# router, shared-expert gate: whole.
HYBRID_SHARDS = MappingProxyType(
    {
        "self_attn.q_proj.weight": "q_gate_heads",
        "self_attn.k_proj.weight": "kv_heads",
        "self_attn.v_proj.weight": "kv_heads",
        "self_attn.o_proj.weight": "q_columns",
        "linear_attn.in_proj_qkv.weight": "gdn_channels",  # Qwen3.5
        "linear_attn.in_proj_z.weight": "value_rows",
        "linear_attn.in_proj_b.weight": "value_entries",
        "linear_attn.in_proj_a.weight": "value_entries",
        "linear_attn.in_proj_qkvz.weight": "key_groups",  # Qwen3-Next
        "linear_attn.in_proj_ba.weight": "key_groups_ba",
        "linear_attn.conv1d.weight": "gdn_channels",
        "linear_attn.A_log": "value_entries",
        "linear_attn.dt_bias": "value_entries",
        "linear_attn.out_proj.weight": "value_columns",
        "mlp.gate_proj.weight": "mlp_rows",
        "mlp.up_proj.weight": "mlp_rows",
        "mlp.down_proj.weight": "mlp_columns",
        "mlp.experts.*.gate_proj.weight": "expert_mlp_rows",
        "mlp.experts.*.up_proj.weight": "expert_mlp_rows",
        "mlp.experts.*.down_proj.weight": "expert_mlp_columns",
        "mlp.shared_expert.gate_proj.weight": "shared_mlp_rows",
        "mlp.shared_expert.up_proj.weight": "shared_mlp_rows",
        "mlp.shared_expert.down_proj.weight": "shared_mlp_columns",
        "embed_tokens.weight": "vocab_rows",
        "lm_head.weight": "vocab_rows",
    }
)


@dataclass
class AttentionWeights:
    qkv: torch.Tensor  # [H*2D + 2*Hkv*D, d]: per head q then its gate, then k rows, then v rows
    o: torch.Tensor  # [d, H*D]
    q_norm: torch.Tensor  # [D] float32, 1 + w
    k_norm: torch.Tensor  # [D] float32, 1 + w


@dataclass
class DenseMLPWeights:
    gate_up: torch.Tensor  # [2I, d]
    down: torch.Tensor  # [d, I]


@dataclass
class HybridLayerWeights:
    input_norm: torch.Tensor  # [d] float32, 1 + w
    post_norm: torch.Tensor  # [d] float32, 1 + w
    mixer: GDNWeights | AttentionWeights
    mlp: DenseMLPWeights | MoEWeights


@dataclass
class HybridWeights:
    embed: torch.Tensor  # [V, d]
    layers: list[HybridLayerWeights]
    final_norm: torch.Tensor  # [d] float32, 1 + w
    lm_head: torch.Tensor  # [V, d]


def text_prefix(tensors: dict) -> str:
    """Qwen3.5 vision-language checkpoints keep the text model under model.language_model."""
    return "model.language_model." if "model.language_model.embed_tokens.weight" in tensors else "model."


def build_hybrid_weights(cfg: ModelConfig, tensors: dict, dtype: torch.dtype, device) -> HybridWeights:
    f = _Fetcher(tensors, dtype, device)
    root = text_prefix(tensors)
    d, hy = cfg.hidden_size, cfg.family_config

    def zero_centred(name: str, size: int) -> torch.Tensor:
        return 1.0 + _Fetcher(tensors, torch.float32, device).get(name, (size,))

    layers = []
    for i in range(cfg.num_layers):
        p = f"{root}layers.{i}."
        mixer = (
            _gdn(f, p + "linear_attn.", cfg) if hy.is_linear(i) else _attention(f, p + "self_attn.", cfg, zero_centred)
        )
        mlp = _moe(f, p + "mlp.", cfg) if hy.moe is not None and hy.moe.sparse_at(i) else _dense_mlp(f, p + "mlp.", cfg)
        layers.append(
            HybridLayerWeights(
                zero_centred(p + "input_layernorm.weight", d),
                zero_centred(p + "post_attention_layernorm.weight", d),
                mixer,
                mlp,
            )
        )
    embed = f.get(root + "embed_tokens.weight", (cfg.held_vocab, d))
    lm_head = embed if cfg.tie_word_embeddings else f.get("lm_head.weight", (cfg.held_vocab, d))
    return HybridWeights(embed, layers, zero_centred(root + "norm.weight", d), lm_head)


def _attention(f: _Fetcher, p: str, cfg: ModelConfig, zero_centred) -> AttentionWeights:
    d, hd = cfg.hidden_size, cfg.head_dim
    qkv = torch.cat(
        [
            f.get(p + "q_proj.weight", (2 * cfg.num_heads * hd, d)),
            f.get(p + "k_proj.weight", (cfg.num_kv_heads * hd, d)),
            f.get(p + "v_proj.weight", (cfg.num_kv_heads * hd, d)),
        ]
    )
    return AttentionWeights(
        qkv.contiguous(),
        f.get(p + "o_proj.weight", (d, cfg.num_heads * hd)),
        zero_centred(p + "q_norm.weight", hd),
        zero_centred(p + "k_norm.weight", hd),
    )


def _gdn(f: _Fetcher, p: str, cfg: ModelConfig) -> GDNWeights:
    hy, d = cfg.family_config, cfg.hidden_size
    fused = f.has(p + "in_proj_qkvz.weight")  # Qwen3-Next's layout
    hv, vd = hy.value_heads, hy.value_heads * hy.value_head_dim
    in_proj = (
        _fused_in_proj(f, p, hy, d)
        if fused
        else torch.cat(
            [
                f.get(p + "in_proj_qkv.weight", (hy.conv_channels, d)),
                f.get(p + "in_proj_b.weight", (hv, d)),
                f.get(p + "in_proj_a.weight", (hv, d)),
                f.get(p + "in_proj_z.weight", (vd, d)),
            ]
        )
    )
    f32 = _Fetcher(f.tensors, torch.float32, f.device)
    return GDNWeights(
        in_proj=in_proj.contiguous(),
        conv=f.get(p + "conv1d.weight", (hy.conv_channels, 1, hy.conv_kernel))[:, 0].contiguous(),
        neg_decay=-f32.get(p + "A_log", (hv,)).exp(),
        dt_bias=f32.get(p + "dt_bias", (hv,)),
        norm=f.get(p + "norm.weight", (hy.value_head_dim,)),
        out=f.get(p + "out_proj.weight", (d, vd)),
    )


def _fused_in_proj(f: _Fetcher, p: str, hy: HybridConfig, d: int) -> torch.Tensor:
    """Qwen3-Next: in_proj_qkvz rows are grouped per key head g as [q_g | k_g | v_g | z_g] (v_g, z_g
    holding that group's r = Hv/Hk value heads), in_proj_ba as [b_g | a_g]; regroup to
    [q | k | v | b | a | z] with value head g*r + j in group g's j-th place."""
    hk, dk, dv, r = hy.key_heads, hy.key_head_dim, hy.value_head_dim, hy.value_heads // hy.key_heads
    qkvz = f.get(p + "in_proj_qkvz.weight", (hk * (2 * dk + 2 * r * dv), d)).view(hk, 2 * dk + 2 * r * dv, d)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)  # [Hk, rows, d] each
    ba = f.get(p + "in_proj_ba.weight", (2 * hy.value_heads, d)).view(hk, 2 * r, d)
    b, a = ba.split([r, r], dim=1)
    return torch.cat([t.reshape(-1, d) for t in (q, k, v, b, a, z)])


def _dense_mlp(f: _Fetcher, p: str, cfg: ModelConfig) -> DenseMLPWeights:
    return _dense_mlp_sized(f, p, cfg.hidden_size, cfg.intermediate_size)


def _moe(f: _Fetcher, p: str, cfg: ModelConfig) -> MoEWeights:
    moe, d = cfg.family_config.moe, cfg.hidden_size
    inter, shared = moe.expert_intermediate_size, moe.shared_intermediate_size
    experts = [_dense_mlp_sized(f, f"{p}experts.{e}.", d, inter) for e in range(moe.num_experts)]
    shared_mlp = _dense_mlp_sized(f, p + "shared_expert.", d, shared)
    return MoEWeights(
        router=f.get(p + "gate.weight", (moe.num_experts, d)),
        gate_up=torch.stack([e.gate_up for e in experts]),
        down=torch.stack([e.down for e in experts]),
        shared_gate_up=shared_mlp.gate_up,
        shared_down=shared_mlp.down,
        shared_gate=f.get(p + "shared_expert_gate.weight", (1, d)),
    )


def _dense_mlp_sized(f: _Fetcher, p: str, d: int, inter: int) -> DenseMLPWeights:
    gate_up = torch.cat([f.get(p + "gate_proj.weight", (inter, d)), f.get(p + "up_proj.weight", (inter, d))])
    return DenseMLPWeights(gate_up.contiguous(), f.get(p + "down_proj.weight", (d, inter)))


def hybrid_weight_names(cfg: ModelConfig, fused_gdn: bool) -> list[str]:
    """The Hugging Face tensor names a complete text checkpoint of `cfg` holds."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    gdn = ("in_proj_qkvz", "in_proj_ba") if fused_gdn else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    gdn = tuple(f"linear_attn.{n}.weight" for n in gdn + ("conv1d", "norm", "out_proj")) + (
        "linear_attn.A_log",
        "linear_attn.dt_bias",
    )
    attn = tuple(f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + n for n in (gdn if cfg.family_config.is_linear(i) else attn)]
        moe = cfg.family_config.moe
        if moe is not None and moe.sparse_at(i):
            names += [
                f"{p}mlp.experts.{e}.{m}.weight"
                for e in range(moe.num_experts)
                for m in ("gate_proj", "up_proj", "down_proj")
            ]
            names += [f"{p}mlp.shared_expert.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
            names += [p + "mlp.gate.weight", p + "mlp.shared_expert_gate.weight"]
        else:
            names += [f"{p}mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    return names
