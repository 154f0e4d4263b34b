"""A test-only model family: layer 0 keeps a per-sequence running sum (a recurrent state, no
K/V), layer 1 is single-head causal attention over the paged KV cache. It plugs in through
the model registry and its cache spec alone; nothing in the runtime knows of it.

Math, per position t with embedding e_t:
  layer 0 (recurrent): s_t = s_{t-1} + e_t (s_{-1} = 0);  h_t = e_t + tanh(W0 s_t)
  layer 1 (attention): q, k, v = Wq h, Wk h, Wv h;  a_t = softmax_{u<=t}(q_t.k_u / sqrt(d)) v;
                       y_t = h_t + Wo a_t
  logits_t = Wlm y_t
"""

from __future__ import annotations

import torch

from ridgefill_runtime.cache.build import ModelCaches
from ridgefill_runtime.cache.spec import AttentionCache, CacheSpec, RecurrentCache
from ridgefill_runtime.config import ModelConfig
from ridgefill_runtime.layers.attention import AttentionBatch, paged_attention
from ridgefill_runtime.models.family import ModelFamily
from ridgefill_runtime.models.forward import ForwardBatch, ForwardOutput

NAME = "toy-recurrent"
WEIGHTS = ("embed", "w0", "wq", "wk", "wv", "wo", "lm_head")


def toy_config(vocab: int = 40, width: int = 8, max_positions: int = 512) -> ModelConfig:
    return ModelConfig(
        architecture=NAME,
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width,
        num_layers=2,
        num_heads=1,
        num_kv_heads=1,
        head_dim=width,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


def toy_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, v = config.hidden_size, config.vocab_size
    shapes = dict(embed=(v, d), w0=(d, d), wq=(d, d), wk=(d, d), wv=(d, d), wo=(d, d), lm_head=(v, d))
    return {name: torch.randn(shape, generator=g, dtype=torch.float64) / d**0.5 * 2 for name, shape in shapes.items()}


class ToyRecurrentLM:
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
    ):
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.w = {name: tensors[name].to(dtype=dtype, device=self.device) for name in WEIGHTS}

    def cache_spec(self) -> CacheSpec:
        d = self.config.hidden_size
        return CacheSpec(layers=(RecurrentCache((("sum", (d,)),)), AttentionCache(1, d)), dtype=self.dtype)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> ForwardOutput:
        """The runner's entry (models/forward.py): the exact forward; no two-sweep prefill."""
        if batch.fill is not None:
            raise ValueError("the toy family has no two-sweep prefill")
        return ForwardOutput(
            self.forward(batch.input_ids, batch.positions, batch.attention, batch.caches, batch.logit_rows)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        caches: ModelCaches,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows [N] -> float logits [R, V]."""
        e = self.w["embed"][input_ids]  # [N, d]
        h = e + torch.tanh(self._running_sums(e, batch, caches.states.state(0)["sum"]) @ self.w["w0"].T)
        q, k, v = (h @ self.w[n].T for n in ("wq", "wk", "wv"))  # [N, d] each
        d = self.config.hidden_size
        attn = paged_attention(q[:, None], k[:, None], v[:, None], caches.kv, 1, batch, d**-0.5)  # [N, d]
        y = h + attn @ self.w["wo"].T
        logits = (y @ self.w["lm_head"].T).float()  # [N, V]
        return logits if logit_rows is None else logits[logit_rows]

    @staticmethod
    def _running_sums(e: torch.Tensor, batch: AttentionBatch, sums: torch.Tensor) -> torch.Tensor:
        """s_t for every row [N, d], continuing each sequence's sum from its state slot
        (sums [slots, d]); a sequence starting at position 0 starts from nothing."""
        out = torch.empty_like(e)
        for i, slot in enumerate(batch.state_slots):
            lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
            first = batch.context_lens[i] - (hi - lo)
            before = torch.zeros_like(sums[slot]) if first == 0 else sums[slot]
            out[lo:hi] = before + e[lo:hi].cumsum(0)
            sums[slot] = out[hi - 1]
        return out


def reference_logits(tensors: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The same math as a plain float64 loop over positions: logits [L, V]."""
    w = {n: t.double() for n, t in tensors.items()}
    d = w["embed"].shape[1]
    s, keys, values, out = torch.zeros(d, dtype=torch.float64), [], [], []
    for t in ids:
        e = w["embed"][t]
        s = s + e
        h = e + torch.tanh(w["w0"] @ s)
        keys.append(w["wk"] @ h)
        values.append(w["wv"] @ h)
        scores = torch.stack(keys) @ (w["wq"] @ h) / d**0.5
        a = scores.softmax(0) @ torch.stack(values)
        out.append(w["lm_head"] @ (h + w["wo"] @ a))
    return torch.stack(out)


def _no_hf_config(family, raw, generation, where):
    raise ValueError(f"{where}: the toy family has no checkpoint format")


TOY_FAMILY = ModelFamily(
    name=NAME, model_class=ToyRecurrentLM, parse_hf_config=_no_hf_config, weight_names=lambda config: list(WEIGHTS)
)
