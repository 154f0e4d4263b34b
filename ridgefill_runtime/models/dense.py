"""Llama / Qwen3 decoder (GQA, RoPE, optional QK-norm) over the paged KV cache.

The model sees flat rows, positions and an AttentionBatch; it knows nothing of requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..layers.attention import AttentionBatch, paged_attention, paged_attention_rows
from ..layers.mlp import swiglu_mlp
from ..layers.rotary import RotaryTable, apply_rotary
from ..ops.rms_norm import rms_norm
from .weights import DenseWeights, LayerWeights, build_weights


class DenseLM:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights: DenseWeights = build_weights(config, tensors, dtype, self.device)
        self.rotary = RotaryTable(config, self.device)
        self.scale = config.head_dim ** -0.5

    # -- pieces (RidgeFill runs some of them on their own) ---------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> hidden [N, d]."""
        return self.weights.embed[input_ids]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for rows at `positions` [N]; computed once per forward, used by every layer."""
        return self.rotary.lookup(positions, self.dtype)

    def qkv(self, layer: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Layer input [N, d] -> q [N, H, D], k/v [N, Hkv, D], RoPE applied."""
        cfg, w = self.config, self.weights.layers[layer]
        x = rms_norm(h, w.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, w.qkv, w.qkv_bias)  # [N, (H + 2Hkv) * D]
        n, hd = h.shape[0], cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q = qkv[:, :q_dim].view(n, cfg.num_heads, hd)
        k = qkv[:, q_dim:q_dim + kv_dim].view(n, cfg.num_kv_heads, hd)
        v = qkv[:, q_dim + kv_dim:].view(n, cfg.num_kv_heads, hd)
        if cfg.qk_norm:
            q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def layer(self, layer: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              batch: AttentionBatch, kv) -> torch.Tensor:
        """One decoder layer: hidden [N, d] -> [N, d], writing its K/V to the cache."""
        w: LayerWeights = self.weights.layers[layer]
        q, k, v = self.qkv(layer, h, rope)
        attn = paged_attention(q, k, v, kv, layer, batch, self.scale)  # [N, H*D]
        h = h + F.linear(attn, w.o)
        x = rms_norm(h, w.post_norm, self.config.rms_norm_eps)
        return h + swiglu_mlp(x, w.gate_up, w.down)

    def last_layer_rows(self, h: torch.Tensor, rope, batch: AttentionBatch, kv,
                        rows: torch.Tensor) -> torch.Tensor:
        """The final layer for chosen rows only: hidden [N, d] -> [R, d].

        NOTE: every row still writes its K/V (later tokens need them), but attention,
        the output projection and the MLP run only where logits are wanted.
        """
        layer = self.config.num_layers - 1
        w: LayerWeights = self.weights.layers[layer]
        q, k, v = self.qkv(layer, h, rope)
        attn = paged_attention_rows(q[rows], rows, k, v, kv, layer, batch, self.scale)  # [R, H*D]
        h = h[rows] + F.linear(attn, w.o)
        x = rms_norm(h, w.post_norm, self.config.rms_norm_eps)
        return h + swiglu_mlp(x, w.gate_up, w.down)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden rows [R, d] -> float32 logits [R, V]."""
        x = rms_norm(h, self.weights.final_norm, self.config.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()

    # -- the whole model --------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv, logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [N] -> logits [R, V] for the sorted `logit_rows` (all rows when None)."""
        h = self.embed(input_ids)
        rope = self.rope(positions)
        last = self.config.num_layers - 1
        for i in range(last):
            h = self.layer(i, h, rope, batch, kv)
        if logit_rows is None:
            h = self.layer(last, h, rope, batch, kv)
        else:
            h = self.last_layer_rows(h, rope, batch, kv, logit_rows)
        return self.logits(h)
