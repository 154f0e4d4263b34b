"""Llama / Qwen3 decoder (GQA, RoPE, optional QK-norm) over the paged KV cache.

The model sees flat rows, positions and an AttentionBatch; it knows nothing of requests. RidgeFill's
two-sweep prefill (fill/two_sweep.py) runs it through the hooks of models/fill_hooks.py: every layer
keeps K/V, and a late layer is the exact layer over the late part.
"""

from __future__ import annotations

import torch

from ..cache.build import kv_pool_of
from ..cache.spec import CacheSpec
from ..config import ModelConfig
from ..layers.attention import AttentionBatch, paged_attention, paged_attention_rows
from ..layers.mlp import swiglu_mlp
from ..layers.rotary import RotaryTable
from ..layers.vocab import embed_tokens, vocab_logits
from ..ops.norm_rope import norm_rope
from ..ops.packed_linear import linear, weight_slice
from ..ops.rms_norm import rms_norm, rms_norm_add
from .fill_hooks import LateRows, unsharded
from .forward import ForwardBatch, ForwardOutput
from .weights import DenseWeights, build_weights


class DenseLM:
    # NOTE: the rescale reads the late rows' K/V as the layer made them (its on_kv hook)
    rescale_from_layer_kv = True
    # A tensor-parallel rank's o and down products (and the selectors' attention mass) are partial
    # sums over its heads and MLP columns; parallel/ sets this to the group's in-place all-reduce.
    # Alone, each is whole already.
    sum_shards = staticmethod(unsharded)
    gather_vocab = staticmethod(unsharded)  # a rank's logits [R, V_rank] -> every rank's [R, V]

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights: DenseWeights = build_weights(config, tensors, dtype, self.device)
        self.rotary = RotaryTable(config, self.device)
        self.scale = config.attention_scale or config.head_dim**-0.5

    def cache_spec(self) -> CacheSpec:
        """Every layer keeps paged K/V; the fill's stash keeps hidden-size split states."""
        return CacheSpec.dense(self.config, self.dtype)

    # -- pieces (RidgeFill runs some of them on their own) ---------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> hidden [N, d]."""
        return embed_tokens(self.weights.embed, input_ids, self.dtype, self.config.vocab_rows, self.sum_shards)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos, sin for rows at `positions` [N]; computed once per forward, used by every layer.
        A family may return more tensors (one pair per RoPE base); layer_rope picks a layer's."""
        return self.rotary.lookup(positions, self.dtype)

    def layer_rope(self, layer: int, rope: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The (cos, sin) pair of `rope` that `layer` turns by."""
        return rope

    def window(self, layer: int) -> int:
        """The layer's sliding window (0: it sees every earlier key)."""
        return self.config.family_config.window_of(layer)

    def keeps_kv(self, layer: int) -> bool:
        """Every layer attends over paged K/V."""
        return True

    def qkv(self, layer: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """Layer input [N, d] -> q [N, H, D], k/v [N, Hkv, D], RoPE applied."""
        cfg, w = self.config, self.weights.layers[layer]
        x = rms_norm(h, w.input_norm, cfg.rms_norm_eps)
        qkv = linear(x, w.qkv, w.qkv_bias)  # [N, (H + 2Hkv) * D]
        n, hd = h.shape[0], cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * hd, cfg.num_kv_heads * hd
        v = qkv[:, q_dim + kv_dim :].view(n, cfg.num_kv_heads, hd)
        cos, sin = self.layer_rope(layer, rope)
        if cfg.qk_norm:
            q = norm_rope(qkv[:, :q_dim].view(n, cfg.num_heads, hd), cos, sin, w.q_norm, cfg.rms_norm_eps)
            k = norm_rope(
                qkv[:, q_dim : q_dim + kv_dim].view(n, cfg.num_kv_heads, hd), cos, sin, w.k_norm, cfg.rms_norm_eps
            )
            return q, k, v
        # NOTE: q and k lie side by side in the fused output: one rotation covers both heads' sets
        qk = norm_rope(qkv[:, : q_dim + kv_dim].view(n, cfg.num_heads + cfg.num_kv_heads, hd), cos, sin)
        return qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], v

    def kv_only(self, layer: int, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """What a filled row writes: layer input [F, d] -> k, v [F, Hkv, D] (norm, K/V
        projections, K-norm, RoPE at its own position; no query, no attention, no MLP)."""
        cfg, w = self.config, self.weights.layers[layer]
        q_dim, hd = cfg.num_heads * cfg.head_dim, cfg.head_dim
        xn = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
        bias = None if w.qkv_bias is None else w.qkv_bias[q_dim:]
        kv = linear(xn, weight_slice(w.qkv, q_dim, w.qkv.shape[0]), bias)  # [F, 2 * Hkv * D]
        k, v = kv.view(x.shape[0], 2, cfg.num_kv_heads, hd).unbind(1)
        cos, sin = self.layer_rope(layer, rope)
        return norm_rope(k, cos, sin, w.k_norm if cfg.qk_norm else None, cfg.rms_norm_eps), v

    def layer(
        self,
        layer: int,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
        kv,
        rows: torch.Tensor | None = None,
        on_kv=None,
        on_q=None,
    ) -> torch.Tensor:
        """One decoder layer: hidden [N, d] -> [N, d] (or [R, d] for `rows`), writing all
        N rows' K/V to the cache.

        NOTE: with `rows`, attention, the output projection and the MLP run only for those
        rows (the final layer, where only some rows need logits). `on_kv(layer, k, v)` sees
        this layer's fresh K/V before anything attends (the fill's rescale hooks in here);
        `on_q(layer, q)` sees every row's query once the cache holds this layer's K/V (the
        selectors record attention there).
        """
        kv = kv_pool_of(kv)
        q, k, v = self.qkv(layer, h, rope)
        if on_kv is not None:
            on_kv(layer, k, v)
        window = self.window(layer)
        if rows is None:
            attn = paged_attention(q, k, v, kv, layer, batch, self.scale, window)  # [N, H*D]
        else:
            attn = paged_attention_rows(q[rows], rows, k, v, kv, layer, batch, self.scale, window)  # [R, H*D]
            h = h[rows]
        if on_q is not None:
            on_q(layer, q)
        return self.finish_layer(layer, h, attn)

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """After attention: residual [R, d] + output projection of attn [R, H*D], then the MLP."""
        w = self.weights.layers[layer]
        h, x = rms_norm_add(self.sum_shards(linear(attn, w.o)), h, self.config.rms_norm_eps, next_weight=w.post_norm)
        return h + self.sum_shards(swiglu_mlp(x, w.gate_up, w.down))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden rows [R, d] -> float32 logits [R, V]."""
        x = rms_norm(h, self.weights.final_norm, self.config.rms_norm_eps)
        return vocab_logits(x, self.weights.lm_head, self.gather_vocab).float()

    # -- the whole model --------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """The exact forward over the runner's batch (models/forward.py). NOTE: a step carrying a fill
        plan runs through fill/two_sweep.py instead, which calls this model's hooks itself."""
        if batch.fill is not None:
            raise ValueError(f"{type(self).__name__}.run is the exact forward; a two-sweep step runs through fill/")
        return ForwardOutput(
            self.forward(batch.input_ids, batch.positions, batch.attention, batch.caches, batch.logit_rows)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The exact model: rows [N] -> logits [R, V] for the sorted `logit_rows` (all rows when
        None). `kv`: the runner's ModelCaches, or a bare KVPool."""
        kv = kv_pool_of(kv)
        h = self.embed(input_ids)
        rope = self.rope(positions)
        last = self.config.num_layers - 1
        for i in range(last):
            h = self.layer(i, h, rope, batch, kv)
        return self.logits(self.layer(last, h, rope, batch, kv, rows=logit_rows))

    def late_layer(self, i: int, h: torch.Tensor, late: LateRows, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i of the two-sweep prefill's late part [M, d]: the exact layer (every late row is
        exact here), its fresh K/V shown to late.on_kv before anything attends."""
        return self.layer(i, h, late.rope, late.batch, late.caches, rows=rows, on_kv=late.on_kv, on_q=late.on_q)
