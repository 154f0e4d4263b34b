"""A looped (recurrent-depth) decoder in Huginn's layout (seed 001 §2, Eq. (1)-(2)):

    e_t = prelude(embed(x_t) * embed_scale)
    s_t^(0) ~ truncated normal, seeded by (request seed, t)      (so a token's computation is the same
                                                                  decoded alone or verified in a block)
    s_t^(r) = core(adapter([s_t^(r-1), e_t]))                    r = 1..R, core = n_core sandwich blocks
    logits  = head(ln_f(coda(ln_f(s_t^(R)))))

Every layer is a sandwich block: x = n2(attn(n1(x)) + x); x = n4(mlp(n3(x)) + x), q/k bias before the
interleaved-pair rotary. Prelude and coda attend over ordinary paged K/V; the core layers over the
loop-plane cache through layers/loop_attention.py, per sequence under its own loop count and policy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.spec import AttentionCache, CacheSpec, LoopPlanesCache
from ..config import LoopConfig, ModelConfig
from .looped_config import LoopedConfig
from ..layers.attention import AttentionBatch, paged_attention
from ..layers.loop_attention import LoopAttention, LoopRead, default_reads
from ..layers.mlp import swiglu_mlp
from ..layers.rotary import RotaryTable
from ..layers.vocab import embed_tokens, vocab_logits
from ..ops.rms_norm import rms_norm as _rms_norm_op
from .fill_hooks import unsharded
from .forward import ForwardBatch, ForwardOutput
from .looped_weights import LoopedWeights, SandwichWeights, build_looped_weights


class LoopedLM:
    # A tensor-parallel rank's proj and mlp.proj products are partial sums over its heads and MLP
    # columns; parallel/ sets this to the group's in-place all-reduce.
    sum_shards = staticmethod(unsharded)
    gather_vocab = staticmethod(unsharded)  # a rank's logits [R, V_rank] -> every rank's [R, V]

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if not isinstance(config.family_config, LoopedConfig):
            raise ValueError(f"{type(self).__name__} needs a looped model config")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.weights: LoopedWeights = build_looped_weights(config, tensors, dtype, self.device)
        self.rotary = RotaryTable(config, self.device)
        self.scale = config.head_dim**-0.5
        lc = config.family_config
        self.prelude = range(lc.prelude)
        self.core = range(lc.prelude, lc.prelude + lc.core)
        self.coda = range(lc.prelude + lc.core, config.num_layers)
        self.use_ripe_op: bool | None = None  # None: the compiled op on CUDA (tests force it on CPU)

    def cache_spec(self, serve: LoopConfig | None = None) -> CacheSpec:
        return loop_cache_spec(self.config, serve, self.dtype)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> ForwardOutput:
        if batch.fill is not None:
            raise ValueError(f"{type(self).__name__} has no two-sweep prefill")
        return ForwardOutput(
            self.forward(batch.input_ids, batch.positions, batch.attention, batch.caches, batch.logit_rows, batch.loops)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        caches,
        logit_rows: torch.Tensor | None = None,
        reads: tuple[LoopRead, ...] | None = None,
    ) -> torch.Tensor:
        """Rows [N] -> float32 logits [R, V] for the sorted `logit_rows` (every row when None).
        `reads`: per sequence its loops and cache policy (None: the storage's own)."""
        storage: LoopPlanesCache = caches.spec.layers[self.core[0]]
        reads = reads or default_reads(storage, batch.num_seqs)
        rope = self.rope(positions)
        h = embed_tokens(self.weights.embed, input_ids, self.dtype, self.config.vocab_rows, self.sum_shards)
        h = h * self.config.family_config.embed_scale  # [N, d]
        for layer in self.prelude:
            h = self.block(layer, h, rope, self._paged(layer, batch, caches))
        s = self.loop(
            h, positions, rope, LoopAttention(storage, caches, batch, reads, self.scale, self.use_ripe_op), reads
        )
        h = self.norm(s)
        for layer in self.coda:
            h = self.block(layer, h, rope, self._paged(layer, batch, caches))
        if logit_rows is not None:
            h = h[logit_rows]
        logits = vocab_logits(self.norm(h), self.weights.lm_head, self.gather_vocab)
        return logits if logits.dtype == torch.float64 else logits.float()  # NOTE: float64 stays (reference tests)

    # -- pieces --------------------------------------------------------------------------------

    def loop(
        self, e: torch.Tensor, positions: torch.Tensor, rope, attention: LoopAttention, reads: tuple[LoopRead, ...]
    ) -> torch.Tensor:
        """The core block R times over every row's state; a sequence with fewer loops stops early."""
        starts = attention.row_starts
        row_seeds = torch.cat(
            [
                torch.full((hi - lo,), reads[i].seed, dtype=torch.int64)
                for i, (lo, hi) in enumerate(zip(starts, starts[1:]))
            ]
        )
        s = initial_states(row_seeds, positions.cpu(), self.config).to(self.device, self.dtype)  # [N, d]
        for r in range(1, max(read.loops for read in reads) + 1):
            seqs = [i for i, read in enumerate(reads) if read.loops >= r]
            rows, sub_starts = _rows_of(seqs, starts, s.device)
            x = s if rows is None else s[rows]
            ea = e if rows is None else e[rows]
            ra = rope if rows is None else tuple(t[rows] for t in rope)
            x = F.linear(torch.cat([x, ea], dim=-1), self.weights.adapter, self.weights.adapter_bias)
            for layer in self.core:
                x = self.block(
                    layer, x, ra, lambda q, k, v, layer=layer: attention(layer, r, q, k, v, seqs, sub_starts)
                )
            if rows is None:
                s = x
            else:
                s = s.clone()
                s[rows] = x
        return s

    def block(self, layer: int, x: torch.Tensor, rope, attend) -> torch.Tensor:
        """One sandwich block over rows x [n, d]; attend(q, k, v) -> [n, H*D] writes and reads its cache."""
        w: SandwichWeights = self.weights.blocks[layer]
        cfg, eps = self.config, self.config.rms_norm_eps
        n, hd, heads, kv_heads = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q, k, v = F.linear(rms_norm(x, w.norm_1, eps), w.qkv).split([heads * hd, kv_heads * hd, kv_heads * hd], -1)
        q, k, v = q.view(n, heads, hd), k.view(n, kv_heads, hd), v.reshape(n, kv_heads, hd)
        if w.q_bias is not None:
            q, k = q + w.q_bias, k + w.k_bias
        q, k = rotate_pairs(q, *rope), rotate_pairs(k, *rope)
        x = rms_norm(self.sum_shards(F.linear(attend(q, k, v), w.proj)) + x, w.norm_2, eps)
        mlp = self.sum_shards(swiglu_mlp(rms_norm(x, w.norm_3, eps), w.gate_up, w.down))
        return rms_norm(mlp + x, w.norm_4, eps)

    def rope(self, positions: torch.Tensor):
        """cos, sin [N, 1, D/2] float32 (float64 for a float64 model: the reference tests)."""
        if self.dtype != torch.float64:
            return self.rotary.lookup(positions, torch.float32)
        hd = self.config.head_dim
        inv_freq = self.config.rope_theta ** (
            -torch.arange(0, hd, 2, dtype=torch.float64, device=positions.device) / hd
        )
        angles = positions.double()[:, None, None] * inv_freq
        return angles.cos(), angles.sin()

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)

    def _paged(self, layer: int, batch: AttentionBatch, caches):
        return lambda q, k, v: paged_attention(q, k, v, caches.kv, layer, batch, self.scale)


def loop_cache_spec(cfg: ModelConfig, serve: LoopConfig | None, dtype: torch.dtype) -> CacheSpec:
    """Prelude and coda layers: paged K/V; core layers: the loop planes the operator chose
    (default: the full cache at the model's mean_recurrence)."""
    lc = cfg.family_config
    loops = (serve.loops if serve is not None else None) or lc.mean_recurrence
    kind = serve.cache if serve is not None else "full"
    window = serve.window if kind == "ripe" else 0
    planes = LoopPlanesCache(cfg.num_kv_heads, cfg.head_dim, loops, kind, window)
    att = AttentionCache(cfg.num_kv_heads, cfg.head_dim)
    core = range(lc.prelude, lc.prelude + lc.core)
    return CacheSpec(tuple(planes if i in core else att for i in range(cfg.num_layers)), dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The op (normalise in float32, cast, times weight); float64 (the reference tests) in float64."""
    if x.dtype == torch.float64:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return _rms_norm_op(x, weight, eps)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Huginn's rotary: dims (2i, 2i+1) of each head form a pair turned by angle i (float32).
    x [n, H, D], cos/sin [n, 1, D/2] -> x's dtype."""
    pairs = (x if x.dtype == torch.float64 else x.float()).unflatten(-1, (-1, 2))  # [n, H, D/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2).to(x.dtype)


def initial_state(seed: int, position: int, width: int, std: float, scale: float) -> torch.Tensor:
    """s^(0) of the token at `position` of a request seeded `seed`: [width] float32 from its own
    generator, so it does not depend on which step or batch computes the token."""
    out = torch.zeros(width)
    if std > 0:
        gen = torch.Generator().manual_seed(((seed & 0xFFFFFFFF) << 32) | (position & 0xFFFFFFFF))
        torch.nn.init.trunc_normal_(out, 0.0, std, -3 * std, 3 * std, generator=gen)
    return out * scale


def initial_states(seeds: torch.Tensor, positions: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """[N, d] float32, one initial state per row (seeds [N], positions [N])."""
    lc = config.family_config
    rows = [
        initial_state(int(s), int(p), config.hidden_size, lc.init_std, lc.embed_scale)
        for s, p in zip(seeds.tolist(), positions.tolist())
    ]
    return torch.stack(rows) if rows else torch.zeros(0, config.hidden_size)


def _rows_of(seqs: list[int], starts: list[int], device) -> tuple[torch.Tensor | None, list[int]]:
    """Batch rows of `seqs` (None: every row) and their starts within that subset."""
    if len(seqs) == len(starts) - 1:
        return None, list(starts)
    rows = [torch.arange(starts[i], starts[i + 1]) for i in seqs]
    sub = [0]
    for r in rows:
        sub.append(sub[-1] + len(r))
    return torch.cat(rows).to(device), sub
