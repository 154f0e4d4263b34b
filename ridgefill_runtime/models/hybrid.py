"""Gated DeltaNet hybrid decoder (Qwen3.5, Qwen3-Next): GDN layers over per-sequence state,
gated full-attention layers over the paged KV cache, dense or mixture-of-experts MLPs.

Layer: h += mixer(norm(h)); h += mlp(norm(h)), every norm a zero-centred RMSNorm (weight 1 + w,
applied in float32). The attention layer (seed 000 §2.3): q_proj is twice as wide, each head's
second half an output gate σ(g); q/k get the same zero-centred norm per head; RoPE turns only the
first partial_rotary_factor of each head's dims.

The exact model only for now: a two-sweep prefill (RidgeFill) is refused by the engine, whose
cache spec check sees stash_width 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.build import kv_pool_of
from ..cache.spec import AttentionCache, CacheSpec, RecurrentCache
from ..config import ModelConfig
from ..errors import UnsupportedError
from ..layers.attention import AttentionBatch, paged_attention, paged_attention_rows
from ..layers.gated_deltanet import gdn_mixer, state_shapes
from ..layers.mlp import swiglu_mlp
from ..layers.moe import MoEWeights, sparse_moe
from ..layers.rotary import RotaryTable, apply_rotary
from .forward import ForwardBatch, ForwardOutput
from .hybrid_weights import AttentionWeights, HybridWeights, build_hybrid_weights


def zero_centred_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] normalised and scaled by (1 + w) [n] in float32, then cast back to x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight_plus_one).to(x.dtype)


class HybridLM:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if config.hybrid is None:
            raise ValueError(f"{type(self).__name__} needs a hybrid model config")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.weights: HybridWeights = build_hybrid_weights(config, tensors, dtype, self.device)
        self.rotary_dim = int(config.head_dim * config.hybrid.partial_rotary_factor)
        self.rotary = RotaryTable(config.replace(head_dim=self.rotary_dim), self.device)
        self.scale = config.head_dim ** -0.5

    def cache_spec(self) -> CacheSpec:
        """GDN layers keep a conv + recurrent state per sequence (float32); attention layers paged K/V.
        stash_width 0: no two-sweep prefill on this family yet."""
        cfg = self.config
        gdn = RecurrentCache(state_shapes(cfg.hybrid), dtype=torch.float32)
        att = AttentionCache(cfg.num_kv_heads, cfg.head_dim)
        return CacheSpec(tuple(gdn if cfg.hybrid.is_linear(i) else att for i in range(cfg.num_layers)), self.dtype)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> ForwardOutput:
        if batch.fill is not None:
            raise UnsupportedError(f"{self.config.architecture}: RidgeFill's two-sweep prefill is not built for "
                                   "hybrid models yet")
        return ForwardOutput(self.forward(batch.input_ids, batch.positions, batch.attention, batch.caches,
                                          batch.logit_rows))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, caches,
                logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [N] -> float32 logits [R, V] for the sorted `logit_rows` (every row when None)."""
        h = self.weights.embed[input_ids]  # [N, d]
        rope = self.rotary.lookup(positions, self.dtype)
        last = self.config.num_layers - 1
        for i in range(last):
            h = self.layer(i, h, rope, batch, caches)
        h = self.layer(last, h, rope, batch, caches, rows=logit_rows)
        x = zero_centred_rms_norm(h, self.weights.final_norm, self.config.rms_norm_eps)
        return F.linear(x, self.weights.lm_head).float()

    def layer(self, i: int, h: torch.Tensor, rope, batch: AttentionBatch, caches,
              rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, d] -> [N, d] ([R, d] for `rows`: only those rows go on past the mixer)."""
        cfg, w = self.config, self.weights.layers[i]
        x = zero_centred_rms_norm(h, w.input_norm, cfg.rms_norm_eps)
        if cfg.hybrid.is_linear(i):
            mixed = gdn_mixer(x, w.mixer, cfg.hybrid, batch, caches.states.state(i), cfg.rms_norm_eps)
            if rows is not None:
                mixed, h = mixed[rows], h[rows]
        else:
            mixed = self._attention(i, x, w.mixer, rope, batch, kv_pool_of(caches), rows)
            if rows is not None:
                h = h[rows]
        h = h + mixed
        x = zero_centred_rms_norm(h, w.post_norm, cfg.rms_norm_eps)
        if isinstance(w.mlp, MoEWeights):
            moe = cfg.hybrid.moe
            return h + sparse_moe(x, w.mlp, moe.top_k, moe.norm_topk_prob)
        return h + swiglu_mlp(x, w.mlp.gate_up, w.mlp.down)

    def _attention(self, layer: int, x: torch.Tensor, w: AttentionWeights, rope, batch: AttentionBatch, kv,
                   rows: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        n, hd, heads, kv_heads = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q_gate, k, v = F.linear(x, w.qkv).split([2 * heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        q, gate = q_gate.view(n, heads, 2 * hd).chunk(2, dim=-1)  # [N, H, D] each
        q = self._rotate(zero_centred_rms_norm(q, w.q_norm, cfg.rms_norm_eps), rope)
        k = self._rotate(zero_centred_rms_norm(k.view(n, kv_heads, hd), w.k_norm, cfg.rms_norm_eps), rope)
        v = v.reshape(n, kv_heads, hd)
        gate = gate.reshape(n, heads * hd)
        if rows is None:
            attn = paged_attention(q, k, v, kv, layer, batch, self.scale)  # [N, H*D]
        else:
            attn = paged_attention_rows(q[rows], rows, k, v, kv, layer, batch, self.scale)  # [R, H*D]
            gate = gate[rows]
        return F.linear(attn * torch.sigmoid(gate), w.o)

    def _rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        """RoPE on the first rotary_dim dims of each head [N, heads, D]; the rest pass through."""
        if self.rotary_dim == x.shape[-1]:
            return apply_rotary(x, *rope)
        return torch.cat([apply_rotary(x[..., :self.rotary_dim], *rope), x[..., self.rotary_dim:]], dim=-1)

