"""Gated DeltaNet hybrid decoder (Qwen3.5, Qwen3-Next): GDN layers over per-sequence state,
gated full-attention layers over the paged KV cache, dense or mixture-of-experts MLPs.

Layer: h += mixer(norm(h)); h += mlp(norm(h)), every norm a zero-centred RMSNorm (weight 1 + w,
applied in float32). The attention layer (seed 000 §2.3): q_proj is twice as wide, each head's
second half an output gate σ(g); q/k get the same zero-centred norm per head; RoPE turns only the
first partial_rotary_factor of each head's dims.

RidgeFill's two-sweep prefill (fill/two_sweep.py) runs it through the hooks of models/fill_hooks.py:
a late Gated DeltaNet layer carries its state over every row of the late part, filled prefix rows
included (from x̂_l, seed 000 §2.4 "Two sweeps"); only the exact rows attend and run the MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.build import kv_pool_of
from ..cache.spec import AttentionCache, CacheSpec, RecurrentCache
from ..config import ModelConfig
from .hybrid_config import HybridConfig
from ..layers.attention import AttentionBatch, paged_attention, paged_attention_rows
from ..layers.gated_deltanet import gdn_mixer, state_shapes
from ..layers.mlp import swiglu_mlp
from ..layers.moe import MoEWeights, sparse_moe
from ..layers.rotary import RotaryTable
from ..layers.vocab import embed_tokens, vocab_logits
from ..layers.zero_centred_norm import zero_centred_rms_norm
from ..ops.norm_rope import apply_rotary
from .fill_hooks import LateRows, unsharded
from .forward import ForwardBatch, ForwardOutput
from .hybrid_weights import AttentionWeights, HybridWeights, build_hybrid_weights


class HybridLM:
    # NOTE: the gated attention hands out no K/V: the rescale projects the measuring rows' input
    rescale_from_layer_kv = False
    sum_shards = staticmethod(unsharded)  # a tensor-parallel rank's: its group's all-reduce (llm.py)
    gather_vocab = staticmethod(unsharded)  # a rank's logits [R, V_rank] -> every rank's [R, V]

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if not isinstance(config.family_config, HybridConfig):
            raise ValueError(f"{type(self).__name__} needs a hybrid model config")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.weights: HybridWeights = build_hybrid_weights(config, tensors, dtype, self.device)
        self.rotary_dim = int(config.head_dim * config.family_config.partial_rotary_factor)
        self.rotary = RotaryTable(config.replace(head_dim=self.rotary_dim), self.device)
        self.scale = config.head_dim**-0.5

    def cache_spec(self) -> CacheSpec:
        """GDN layers keep a conv + recurrent state per sequence (float32); attention layers paged K/V;
        the fill's stash keeps hidden-size split states."""
        cfg = self.config
        gdn = RecurrentCache(state_shapes(cfg.family_config), dtype=torch.float32, rollback_parts=("conv", "ssm"))
        att = AttentionCache(cfg.num_kv_heads, cfg.head_dim)
        return CacheSpec(
            tuple(gdn if cfg.family_config.is_linear(i) else att for i in range(cfg.num_layers)),
            self.dtype,
            stash_width=cfg.hidden_size,
        )

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
        caches,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows [N] -> float32 logits [R, V] for the sorted `logit_rows` (every row when None)."""
        h = self.embed(input_ids)  # [N, d]
        rope = self.rope(positions)
        last = self.config.num_layers - 1
        for i in range(last):
            h = self.layer(i, h, rope, batch, caches)
        return self.logits(self.layer(last, h, rope, batch, caches, rows=logit_rows))

    # -- pieces (the two-sweep prefill and the map fit run some of them on their own) ------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_tokens(self.weights.embed, input_ids, self.dtype, self.config.vocab_rows, self.sum_shards)

    def rope(self, positions: torch.Tensor):
        """cos, sin [N, 1, rotary_dim/2] for rows at `positions` [N]."""
        return self.rotary.lookup(positions, self.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden rows [R, d] -> float32 logits [R, V]."""
        x = zero_centred_rms_norm(h, self.weights.final_norm, self.config.rms_norm_eps)
        return vocab_logits(x, self.weights.lm_head, self.gather_vocab).float()

    def keeps_kv(self, layer: int) -> bool:
        """Attention layers keep paged K/V; Gated DeltaNet layers a recurrent state."""
        return not self.config.family_config.is_linear(layer)

    def window(self, layer: int) -> int:
        """No layer has a sliding window."""
        return 0

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Layer i's feed-forward half: h [N, d] -> h + mlp(norm(h))."""
        w, cfg = self.weights.layers[i], self.config
        x = zero_centred_rms_norm(h, w.post_norm, cfg.rms_norm_eps)
        if isinstance(w.mlp, MoEWeights):
            return h + self.sum_shards(
                sparse_moe(x, w.mlp, cfg.family_config.moe.top_k, cfg.family_config.moe.norm_topk_prob)
            )
        return h + self.sum_shards(swiglu_mlp(x, w.mlp.gate_up, w.mlp.down))

    def kv_only(self, layer: int, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """What a filled row writes at an attention layer: layer input [F, d] -> k, v [F, Hkv, D]
        (norm, K/V projections, K-norm, partial RoPE; no query, gate, attention or MLP)."""
        cfg, w = self.config, self.weights.layers[layer]
        n, hd, kv_heads = x.shape[0], cfg.head_dim, cfg.num_kv_heads
        xn = zero_centred_rms_norm(x, w.input_norm, cfg.rms_norm_eps)
        k, v = F.linear(xn, w.mixer.qkv[2 * cfg.num_heads * hd :]).view(n, 2, kv_heads, hd).unbind(1)
        return self._rotate(zero_centred_rms_norm(k, w.mixer.k_norm, cfg.rms_norm_eps), rope), v

    def layer(
        self, i: int, h: torch.Tensor, rope, batch: AttentionBatch, caches, rows: torch.Tensor | None = None, on_q=None
    ) -> torch.Tensor:
        """hidden [N, d] -> [N, d] ([R, d] for `rows`: only those rows go on past the mixer).
        on_q(layer, q) sees an attention layer's queries once the cache holds its K/V."""
        cfg, w = self.config, self.weights.layers[i]
        x = zero_centred_rms_norm(h, w.input_norm, cfg.rms_norm_eps)
        if cfg.family_config.is_linear(i):
            states = caches.states
            mixed = gdn_mixer(
                x,
                w.mixer,
                cfg.family_config,
                batch,
                states.state(i),
                cfg.rms_norm_eps,
                history=states.histories.get(i) if batch.verifies is not None else None,
            )
            if rows is not None:
                mixed, h = mixed[rows], h[rows]
            mixed = self.sum_shards(mixed)  # NOTE: after picking the rows: less to send
        else:
            mixed = self.attention(i, x, rope, batch, kv_pool_of(caches), rows, on_q)
            if rows is not None:
                h = h[rows]
        return self.mlp(i, h + mixed)

    def late_layer(self, i: int, h: torch.Tensor, late: LateRows, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i of the two-sweep prefill's late part h [M, d], updated in place where some rows
        are filled: a Gated DeltaNet layer carries its state over every row, from x̂_i on filled
        rows (they compute only that state update: no output, no attention, no MLP); the exact
        rows run everything, over the filled K/V. Returns h ([R, d] for `rows`)."""
        cfg, w = self.config, self.weights.layers[i]
        exact = late.exact
        if cfg.family_config.is_linear(i):
            x_in = h
            if late.filled is not None:
                x_in = h.clone()
                x_in[late.filled] = late.predicted(i)  # x̂_i: filled rows only carry the state
            xn = zero_centred_rms_norm(x_in, w.input_norm, cfg.rms_norm_eps)
            states = late.caches.states
            mixed = gdn_mixer(
                xn,
                w.mixer,
                cfg.family_config,
                late.batch,
                states.state(i),
                cfg.rms_norm_eps,
                out_rows=exact,
                filled=late.share_filled,
                history=states.histories.get(i) if late.batch.verifies is not None else None,
            )
            h_exact = (x_in if exact is None else x_in[exact]) + self.sum_shards(mixed)
        elif exact is not None and exact.numel() == 0:
            return h if rows is None else h[rows]  # every row of the step is filled: nothing attends
        else:
            h_exact = h if exact is None else h[exact]
            x = zero_centred_rms_norm(h_exact, w.input_norm, cfg.rms_norm_eps)
            h_exact = h_exact + self.attention(
                i, x, late.rope, late.exact_batch, kv_pool_of(late.caches), on_q=late.on_q
            )
        if h_exact.shape[0]:
            h_exact = self.mlp(i, h_exact)
        if exact is None:
            h = h_exact
        else:
            h[exact] = h_exact
        return h if rows is None else h[rows]

    def attention(
        self, layer: int, x: torch.Tensor, rope, batch: AttentionBatch, kv, rows: torch.Tensor | None = None, on_q=None
    ) -> torch.Tensor:
        """Gated attention on normed rows x [N, d] -> [N, d] ([R, d] for `rows`), writing all N rows' K/V."""
        w: AttentionWeights = self.weights.layers[layer].mixer
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
        if on_q is not None:
            on_q(layer, q)
        return self.sum_shards(F.linear(attn * torch.sigmoid(gate), w.o))

    def _rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        """RoPE on the first rotary_dim dims of each head [N, heads, D]; the rest pass through."""
        if self.rotary_dim == x.shape[-1]:
            return apply_rotary(x, *rope)
        return torch.cat([apply_rotary(x[..., : self.rotary_dim], *rope), x[..., self.rotary_dim :]], dim=-1)
