"""An independent token-by-token reference for Huginn-layout looped models, and tiny random
checkpoints written with Huginn's real tensor names and config keys.

The reference is plain loops in float64 over a state dict by Huginn's names: one token at a time,
every layer's keys and values kept in Python lists per (layer, plane), attention as an explicit
softmax, the rotary as complex multiplication. No cache object, no runtime code, except the
initial-state generator (a definition: which random numbers each (seed, position) gets).
A policy π(r, t, j) -> plane names which loop's K/V the query of token t at loop r reads for an
earlier position j (seed 001 Eq. (9)); the full cache is π = r.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from ridgefill_runtime.models.looped import initial_state

TINY_HUGINN = {
    "model_type": "huginn_raven",
    "architectures": ["RavenForCausalLM"],
    "n_embd": 32,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 48,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 2,
    "n_layers_in_coda": 1,
    "n_layers": 5,
    "mean_recurrence": 4,
    "mean_backprop_depth": 2,
    "vocab_size": 61,
    "padded_vocab_size": 64,
    "padding_multiple": 64,
    "block_size": 512,
    "rope_base": 50000.0,
    "norm_eps": 1e-6,
    "qk_bias": True,
    "bias": False,
    "tie_embeddings": True,
    "injection_type": "linear",
    "state_init": "like-init",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_huginn_tensors(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under Huginn's names for config `raw`."""
    gen = torch.Generator().manual_seed(seed)
    d, inter = raw["n_embd"], raw["intermediate_size"]
    heads, kv_heads = raw["n_heads"], raw["num_key_value_heads"]
    hd = d // heads
    rnd = lambda *shape, std=0.3: torch.randn(*shape, generator=gen) * std  # noqa: E731
    norm = lambda: 1.0 + rnd(d, std=0.1)  # noqa: E731
    out = {
        "transformer.wte.weight": rnd(raw["padded_vocab_size"], d, std=0.5),
        "transformer.adapter.weight": rnd(d, 2 * d, std=0.2),
        "transformer.ln_f.weight": norm(),
    }
    if raw.get("bias"):
        out["transformer.adapter.bias"] = rnd(d, std=0.1)
    groups = [
        ("prelude", raw["n_layers_in_prelude"]),
        ("core_block", raw["n_layers_in_recurrent_block"]),
        ("coda", raw["n_layers_in_coda"]),
    ]
    for group, count in groups:
        for i in range(count):
            p = f"transformer.{group}.{i}."
            out.update(
                {
                    p + "norm_1.weight": norm(),
                    p + "attn.Wqkv.weight": rnd((heads + 2 * kv_heads) * hd, d),
                    p + "attn.proj.weight": rnd(d, heads * hd),
                    p + "norm_2.weight": norm(),
                    p + "mlp.fc.weight": rnd(2 * inter, d),
                    p + "mlp.proj.weight": rnd(d, inter),
                    p + "norm_3.weight": norm(),
                    p + "norm_4.weight": norm(),
                }
            )
            if raw.get("qk_bias"):
                out[p + "attn.qk_bias"] = rnd(2, 1, heads, hd, std=0.2)
    return out


def write_tiny_huginn(
    folder: Path, raw: dict = TINY_HUGINN, seed: int = 0, tokenizer: bool = False
) -> dict[str, torch.Tensor]:
    """A Hugging Face folder (config.json + model.safetensors) of a random tiny Huginn-layout model;
    with `tokenizer`, a word-level tokenizer.json whose token i is the word "w{i}"."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = tiny_huginn_tensors(raw, seed)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(folder / "model.safetensors"))
    if tokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = {f"w{i}": i for i in range(raw["padded_vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        tok.save(str(folder / "tokenizer.json"))
    return tensors


def full_policy(r: int, t: int, j: int, loops: int) -> int:
    return r


def ripe_policy(window: int):
    """π_RIPE of Eq. (9): plane r within `window` positions, else the deepest plane R."""
    return lambda r, t, j, loops: r if t - j <= window else loops


class LoopedReference:
    """Token-by-token float64 decoding of one sequence; `planes` keeps every K/V it computed:
    planes[(layer, plane)][j] = (k [Hkv, D], v [Hkv, D]); prelude/coda layers use plane 0."""

    def __init__(self, tensors: dict[str, torch.Tensor], raw: dict, loops: int, seed: int = 0, policy=full_policy):
        self.w = {k: v.double() for k, v in tensors.items()}
        self.raw, self.loops, self.seed, self.policy = raw, loops, seed, policy
        self.d = raw["n_embd"]
        self.heads, self.kv_heads = raw["n_heads"], raw["num_key_value_heads"]
        self.hd = self.d // self.heads
        self.eps = raw["norm_eps"]
        self.planes: dict[tuple[int, int], list] = {}
        self.pos = 0
        p, c = raw["n_layers_in_prelude"], raw["n_layers_in_recurrent_block"]
        self.layers = (
            [("prelude", i) for i in range(p)]
            + [("core_block", i) for i in range(c)]
            + [("coda", i) for i in range(raw["n_layers_in_coda"])]
        )
        self.num_prelude, self.num_core = p, c

    def step(self, token: int) -> torch.Tensor:
        """Logits [V] float64 after `token` at the next position."""
        t = self.pos
        d = self.d
        h = self.w["transformer.wte.weight"][token] * math.sqrt(d)
        for li in range(self.num_prelude):
            h = self._block(li, h, t, plane=0)
        e = h
        s = initial_state(self.seed, t, d, math.sqrt(2 / (5 * d)), math.sqrt(d)).double()
        if self.raw.get("state_init") == "zero":
            s = torch.zeros_like(s)
        for r in range(1, self.loops + 1):
            s = self.w["transformer.adapter.weight"] @ torch.cat([s, e])
            if "transformer.adapter.bias" in self.w:
                s = s + self.w["transformer.adapter.bias"]
            for li in range(self.num_prelude, self.num_prelude + self.num_core):
                s = self._block(li, s, t, plane=r)
        h = self._norm(s, self.w["transformer.ln_f.weight"])
        for li in range(self.num_prelude + self.num_core, len(self.layers)):
            h = self._block(li, h, t, plane=0)
        self.pos += 1
        return self.w["transformer.wte.weight"] @ self._norm(h, self.w["transformer.ln_f.weight"])

    def _block(self, li: int, x: torch.Tensor, t: int, plane: int) -> torch.Tensor:
        group, i = self.layers[li]
        p = f"transformer.{group}.{i}."
        w = self.w
        hd, heads, kvh = self.hd, self.heads, self.kv_heads
        qkv = w[p + "attn.Wqkv.weight"] @ self._norm(x, w[p + "norm_1.weight"])
        q = qkv[: heads * hd].view(heads, hd)
        k = qkv[heads * hd : (heads + kvh) * hd].view(kvh, hd)
        v = qkv[(heads + kvh) * hd :].view(kvh, hd)
        if p + "attn.qk_bias" in w:
            q, k = q + w[p + "attn.qk_bias"][0, 0], k + w[p + "attn.qk_bias"][1, 0]
        q, k = self._rotary(q, t), self._rotary(k, t)
        self.planes.setdefault((li, plane), []).append((k, v))
        keys, values = [], []
        for j in range(t + 1):
            read = plane if (plane == 0 or j == t) else self.policy(plane, t, j, self.loops)
            kj, vj = self.planes[(li, read)][j]
            keys.append(kj)
            values.append(vj)
        out = torch.zeros(heads, hd, dtype=torch.float64)
        for h in range(heads):
            g = h // (heads // kvh)
            scores = torch.tensor([float(q[h] @ kj[g]) / math.sqrt(hd) for kj in keys], dtype=torch.float64)
            probs = torch.softmax(scores, 0)
            for pj, vj in zip(probs, values):
                out[h] += pj * vj[g]
        x = self._norm(w[p + "attn.proj.weight"] @ out.flatten() + x, w[p + "norm_2.weight"])
        y = self._norm(x, w[p + "norm_3.weight"])
        gate, up = (w[p + "mlp.fc.weight"] @ y).chunk(2)
        return self._norm(w[p + "mlp.proj.weight"] @ (torch.nn.functional.silu(gate) * up) + x, w[p + "norm_4.weight"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean() + self.eps) * weight

    def _rotary(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """Pairs (2i, 2i+1) as complex numbers times e^{i t θ_i}, θ_i = base^(-2i/D)."""
        hd = x.shape[-1]
        theta = self.raw["rope_base"] ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(z * torch.polar(torch.ones_like(theta), t * theta)).flatten(-2)
