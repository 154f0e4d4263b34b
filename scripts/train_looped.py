#!/usr/bin/env python3
"""Train a tiny looped (recurrent-depth) language model in Huginn-0125's layout, deterministically.

What it makes: a demonstration checkpoint for ridgefill's looped-model runtime, not a useful LM.
It trains a byte-level BPE tokenizer and a ~4M-parameter "Raven" model (2 prelude blocks, a
4-block recurrent core applied R times, 2 coda blocks) on the Linux kernel documentation, then
writes a Hugging Face style folder:

    config.json  generation_config.json  model.safetensors  tokenizer.json
    tokenizer_config.json  MODEL_CARD.md

and a benchmark note (wall time, loss curve, held-out loss at several loop counts).

Determinism: one fixed seed feeds separate torch.Generators (init, data/loops, eval state), the
thread count is fixed at 2, the step count is fixed, and the data order comes from
`ridgefill_runtime.fill.corpus.calibration_and_heldout()`. Same machine + same command gives the
same weights.

Usage (the run that produced ridgefill_runtime/data/looped):
    python scripts/train_looped.py --out ridgefill_runtime/data/looped
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# The BPE trainer and encoder use a Rust thread pool; pin it to the same 2 cores as torch.
os.environ.setdefault("RAYON_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ridgefill_runtime.fill.corpus import calibration_and_heldout  # noqa: E402

EOT = "<|endoftext|>"
SEED = 1234
THREADS = 2
SEQ_LEN = 256
# Batch 8 rather than 16: at this token budget (~2M tokens) more optimizer steps help more than
# a quieter gradient, and tokens/second on 2 cores is about the same either way.
BATCH = 8
# Timing probe on this machine (2-core AMD EPYC, AVX2, 2 torch threads, batch 8 x 256, float32,
# CPU otherwise idle): step time ~ 1.07 s + 0.078 s per loop, so ~2.1 s at the mean loop count
# p ~ 13. Data prep takes ~20 s, the final eval + sample + save ~2 min. 1000 steps -> ~35 min of
# training, ~38-40 min for the whole run; CPU contention from other jobs makes it slower (2 OpenMP
# threads wait on each other badly when another process takes a core).
MEASURED_SEC_PER_STEP = 2.1
STEPS = 1000
WARMUP = 100
LR = 2.5e-3
MIN_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
MAX_LOOPS = 48  # cap on the sampled loop count p, bounds the cost of one step
EVAL_LOOPS = (1, 2, 4, 8, 12, 16, 24, 32)
EVAL_WINDOWS = 32  # held-out windows (x 256 tokens) for the final loss table
CURVE_EVAL_WINDOWS = 8  # smaller held-out set for the 10% checkpoints of the curve
SAMPLE_PROMPT = "The kernel"
SAMPLE_TOKENS = 40
SAMPLE_LOOPS = 12

CONFIG = {
    "model_type": "huginn_raven",
    "architectures": ["RavenForCausalLM"],
    "n_embd": 192,
    "n_heads": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "intermediate_size": 512,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "n_layers": 8,
    "mean_recurrence": 12,
    "mean_backprop_depth": 4,
    "vocab_size": 2048,
    "padded_vocab_size": 2048,
    "padding_multiple": 64,
    "block_size": 1024,
    "rope_base": 50000.0,
    "norm_eps": 1e-06,
    "qk_bias": True,
    "bias": False,
    "tie_embeddings": True,
    "injection_type": "linear",
    "state_init": "like-init",
}


# ---------------------------------------------------------------------------------------------
# Tokenizer and data
# ---------------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes without an unknown token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],  # first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents joined with <|endoftext|> between them, as one id tensor.

    Encoding each document and inserting the EOT id is the same as encoding the joined string:
    the special token is split out before pre-tokenization either way. Encoding per document lets
    encode_batch use both cores.
    """
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for i, enc in enumerate(tok.encode_batch(texts, add_special_tokens=False)):
        if i:
            ids.append(eot)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len inputs; each row has seq_len + 1 ids (inputs + next-token targets)."""
    n = (len(stream) - 1) // seq_len
    starts = torch.arange(n) * seq_len
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


# ---------------------------------------------------------------------------------------------
# The model (names match the Huginn / Raven checkpoint layout)
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim/2] for pair i rotated by angle pos * base^(-2i/head_dim)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate INTERLEAVED pairs (2i, 2i+1) of each head. x: [B, T, H, hd]; cos/sin: [T, hd/2]."""
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d // n_heads
        self.Wqkv = nn.Linear(d, 3 * d, bias=False)  # rows: q, then k, then v
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, n_heads, self.head_dim))
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.Wqkv(x).view(B, T, 3, self.n_heads, self.head_dim).unbind(2)
        q = apply_rotary(q + self.qk_bias[0], cos, sin)  # bias per head, before rotary
        k = apply_rotary(k + self.qk_bias[1], cos, sin)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # default scale 1/sqrt(head_dim)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class GatedMLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d, 2 * hidden, bias=False)  # first half gate, second half up
        self.proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """Norms around both sublayers and after each residual add (Huginn's sandwich layout)."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, eps = cfg["n_embd"], cfg["norm_eps"]
        self.norm_1 = RMSNorm(d, eps)
        self.attn = Attention(d, cfg["n_heads"])
        self.norm_2 = RMSNorm(d, eps)
        self.mlp = GatedMLP(d, cfg["intermediate_size"])
        self.norm_3 = RMSNorm(d, eps)
        self.norm_4 = RMSNorm(d, eps)

    def forward(self, x, cos, sin):
        x = self.norm_2(self.attn(self.norm_1(x), cos, sin) + x)
        return self.norm_4(self.mlp(self.norm_3(x)) + x)


class Transformer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["n_embd"]
        self.wte = nn.Embedding(cfg["padded_vocab_size"], d)
        self.prelude = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg["n_layers_in_prelude"]))
        self.adapter = nn.Linear(2 * d, d, bias=False)
        self.core_block = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg["n_layers_in_recurrent_block"]))
        self.coda = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg["n_layers_in_coda"]))
        self.ln_f = RMSNorm(d, cfg["norm_eps"])


class RavenLM(nn.Module):
    """Training-side model: full-sequence causal attention, no KV cache, tied head."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.d = cfg["n_embd"]
        self.emb_scale = math.sqrt(self.d)
        self.transformer = Transformer(cfg)
        cos, sin = rotary_tables(cfg["block_size"], self.d // cfg["n_heads"], cfg["rope_base"])
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, gen: torch.Generator) -> None:
        """Normal(0, sqrt(2/(5d))) everywhere; the residual-output projections (attn.proj,
        mlp.proj) are further divided by sqrt(2 * effective depth), effective depth being the
        number of blocks a token passes at the mean recurrence, so the summed residual updates
        stay O(1) at the start. Norm weights start at 1, qk_bias at 0."""
        std = math.sqrt(2 / (5 * self.d))
        cfg = self.cfg
        depth = (
            cfg["n_layers_in_prelude"]
            + cfg["n_layers_in_coda"]
            + cfg["n_layers_in_recurrent_block"] * cfg["mean_recurrence"]
        )
        out_std = std / math.sqrt(2 * depth)
        with torch.no_grad():
            for name, p in self.named_parameters():  # named_parameters order is fixed
                if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                    p.normal_(0.0, out_std, generator=gen)
                elif p.ndim == 2:
                    p.normal_(0.0, std, generator=gen)
                elif "norm" in name or name.endswith("ln_f.weight"):
                    p.fill_(1.0)
                else:  # qk_bias
                    p.zero_()

    def initial_state(self, shape, gen: torch.Generator) -> torch.Tensor:
        """'like-init': truncated normal (std sqrt(2/(5d)), cut at +-3 std) times sqrt(d)."""
        std = math.sqrt(2 / (5 * self.d))
        s = torch.empty(shape)
        nn.init.trunc_normal_(s, 0.0, std, -3 * std, 3 * std, generator=gen)
        return s * self.emb_scale

    def prelude(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = self.transformer.wte(ids) * self.emb_scale
        for block in self.transformer.prelude:
            x = block(x, self.rope_cos[:T], self.rope_sin[:T])
        return x

    def core(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """One loop: inject the prelude output through the adapter, then the 4 core blocks."""
        T = s.shape[1]
        s = self.transformer.adapter(torch.cat([s, e], dim=-1))
        for block in self.transformer.core_block:
            s = block(s, self.rope_cos[:T], self.rope_sin[:T])
        return s

    def coda_logits(self, s: torch.Tensor) -> torch.Tensor:
        """ln_f before the coda and again after it; tied head."""
        T = s.shape[1]
        h = self.transformer.ln_f(s)
        for block in self.transformer.coda:
            h = block(h, self.rope_cos[:T], self.rope_sin[:T])
        return F.linear(self.transformer.ln_f(h), self.transformer.wte.weight)

    def forward(self, ids: torch.Tensor, loops: int, s0: torch.Tensor, grad_loops: int | None = None):
        """R = loops iterations; only the last `grad_loops` keep a graph (truncated backprop)."""
        e = self.prelude(ids)
        s = s0
        grad_loops = loops if grad_loops is None else grad_loops
        no_grad_loops = loops - grad_loops
        if no_grad_loops > 0:
            with torch.no_grad():
                for _ in range(no_grad_loops):
                    s = self.core(s, e)
            s = s.detach()
        for _ in range(grad_loops):
            s = self.core(s, e)
        return self.coda_logits(s)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def sample_loops(cfg: dict, gen: torch.Generator) -> tuple[int, int]:
    """Huginn's schedule: rate ~ LogNormal(ln(t+k) - sigma^2/2, sigma), p = Poisson(rate) + 1.
    The mean of the log-normal is t + k = mean_recurrence. Returns (no-grad loops, grad loops)."""
    k = cfg["mean_backprop_depth"]
    t = cfg["mean_recurrence"] - k
    sigma = 0.5
    mu = math.log(t + k) - sigma**2 / 2
    rate = torch.exp(mu + sigma * torch.randn((), generator=gen, dtype=torch.float64))
    p = int(torch.poisson(rate.reshape(1), generator=gen).item()) + 1
    p = min(p, MAX_LOOPS)
    return max(p - k, 0), min(p, k)


def lr_at(step: int, steps: int) -> float:
    """Linear warmup, then cosine from LR down to MIN_LR_FRACTION * LR."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    frac = (step - WARMUP) / max(1, steps - WARMUP - 1)
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW; weight decay on weight matrices only (not norms, not qk_bias)."""
    decay, no_decay = [], []
    for p in model.parameters():
        (decay if p.ndim == 2 else no_decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=1e-8,
        foreach=True,
    )


@torch.no_grad()
def heldout_loss(model: RavenLM, data: torch.Tensor, loops: int, seed: int, batch: int = 8) -> float:
    """Mean next-token loss over `data` rows. The initial state comes from a generator seeded the
    same way for every loop count, so loop counts are compared on identical inputs and states."""
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        rows = data[i : i + batch]
        x, y = rows[:, :-1], rows[:, 1:]
        s0 = model.initial_state((x.shape[0], x.shape[1], model.d), gen)
        logits = model(x, loops, s0)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
        count += y.numel()
    return total / count


@torch.no_grad()
def greedy_sample(model: RavenLM, tok: Tokenizer, prompt: str, n_tokens: int, loops: int, seed: int) -> str:
    """Greedy decoding by recomputing the whole sequence each token (no cache). One initial state is
    drawn for the full length up front and sliced, so earlier positions keep their state."""
    ids = tok.encode(prompt, add_special_tokens=False).ids
    gen = torch.Generator().manual_seed(seed)
    s_full = model.initial_state((1, len(ids) + n_tokens, model.d), gen)
    for _ in range(n_tokens):
        x = torch.tensor([ids])
        logits = model(x, loops, s_full[:, : len(ids)])
        ids.append(int(logits[0, -1].argmax()))
    return tok.decode(ids)


def train(model, opt, train_rows, held_curve, steps, log, gen):
    """The training loop; returns the loss history and the 10%-checkpoint curve."""
    cfg = model.cfg
    history = []  # (step, loss, p, seconds)
    curve = []  # (step, mean train loss over the last 10%, held-out loss at mean_recurrence)
    checkpoints = {max(1, round(steps * f / 10)) for f in range(1, 11)}
    log_every = max(1, steps // 100)
    window_losses = []
    t_train = time.time()
    for step in range(steps):
        t0 = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        n, k = sample_loops(cfg, gen)
        rows = train_rows[torch.randint(len(train_rows), (BATCH,), generator=gen)]
        x, y = rows[:, :-1], rows[:, 1:]
        s0 = model.initial_state((BATCH, SEQ_LEN, model.d), gen)
        logits = model(x, n + k, s0, grad_loops=k)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        dt = time.time() - t0
        history.append((step + 1, loss.item(), n + k, dt))
        window_losses.append(loss.item())
        if (step + 1) % log_every == 0 or step == 0:
            log(
                f"step {step + 1}/{steps} loss {loss.item():.4f} loops {n + k} (grad {k}) "
                f"lr {lr_at(step, steps):.2e} gnorm {gnorm.item():.2f} {dt:.2f}s/step "
                f"elapsed {time.time() - t_train:.0f}s"
            )
        if step + 1 in checkpoints:
            model.eval()
            h = heldout_loss(model, held_curve, cfg["mean_recurrence"], seed=SEED + 7)
            model.train()
            curve.append((step + 1, sum(window_losses) / len(window_losses), h))
            log(
                f"checkpoint step {step + 1}: mean train loss {curve[-1][1]:.4f}, "
                f"held-out loss @{cfg['mean_recurrence']} loops {h:.4f}"
            )
            window_losses = []
    return history, curve


# ---------------------------------------------------------------------------------------------
# Saving and reports
# ---------------------------------------------------------------------------------------------


def save_folder(out: Path, model: RavenLM, tok: Tokenizer, config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": EOT,
                "eos_token": EOT,
                "pad_token": EOT,
                "model_max_length": 1024,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": False,
            },
            indent=2,
        )
        + "\n"
    )
    # Only persistent parameters; the head is tied to transformer.wte.weight, so no lm_head.weight.
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def check_reload(out: Path, model: RavenLM, rows: torch.Tensor) -> None:
    """The saved file must reproduce the trained model's logits exactly."""
    fresh = RavenLM(model.cfg)
    missing, unexpected = fresh.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    fresh.eval()
    s0 = model.initial_state((1, rows.shape[1] - 1, model.d), torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(rows[:1, :-1], 4, s0)
        b = fresh(rows[:1, :-1], 4, s0)
    assert torch.equal(a, b), "reloaded checkpoint differs"


def markdown_tables(curve, eval_table, cfg):
    curve_md = [
        f"| step | mean train loss (since previous row) | held-out loss @ {cfg['mean_recurrence']} loops |",
        "|---:|---:|---:|",
    ]
    curve_md += [f"| {s} | {tl:.4f} | {hl:.4f} |" for s, tl, hl in curve]
    eval_md = ["| loops | held-out loss | perplexity |", "|---:|---:|---:|"]
    eval_md += [f"| {r} | {l:.4f} | {math.exp(l):.1f} |" for r, l in eval_table]
    return "\n".join(curve_md), "\n".join(eval_md)


def write_reports(out: Path, bench: Path, facts: dict, curve, eval_table, sample: str, cfg: dict) -> None:
    curve_md, eval_md = markdown_tables(curve, eval_table, cfg)
    f = facts
    n_params = f["n_params"]
    card = f"""# ridgefill looped demo model (Huginn-0125 layout, tiny)

**What it is.** A demonstration model for testing ridgefill's looped (recurrent-depth) runtime,
trained on this machine in {f["wall_min"]:.1f} minutes (whole run) on {f["threads"]} CPU threads.
It is **not a useful language model**: {n_params / 1e6:.2f}M parameters, {f["tokens_seen"]:,} training tokens.
It exists so the loader and the recurrent forward pass can be checked against real trained
weights whose loss changes with the loop count.

## Architecture
`model_type: huginn_raven` (`RavenForCausalLM`), the layout of Huginn-0125 scaled down:
d = {cfg["n_embd"]}, {cfg["n_heads"]} heads of 64, gated SiLU MLP of {cfg["intermediate_size"]},
{cfg["n_layers_in_prelude"]} prelude blocks, a {cfg["n_layers_in_recurrent_block"]}-block recurrent
core, {cfg["n_layers_in_coda"]} coda blocks, all "sandwich" blocks (norm_1 .. norm_4), RMSNorm
eps {cfg["norm_eps"]}, interleaved-pair rotary (base {cfg["rope_base"]}), per-head q/k bias,
linear adapter injecting the prelude output at every loop (`s = adapter(cat[s, e])`), initial state
"like-init" (truncated normal, std sqrt(2/(5d)), +-3 std, times sqrt(d)), `ln_f` applied before
and after the coda, tied embeddings (only `transformer.wte.weight` is stored), vocabulary {cfg["vocab_size"]}.
Default loop count (mean_recurrence) {cfg["mean_recurrence"]}. Weights: float32 safetensors.

## Data and licence
Trained on the reStructuredText sources of the Linux kernel documentation
(Debian package linux-doc-6.1, `/usr/share/doc/linux-doc-6.1/Documentation/**/*.rst.gz`),
the calibration split of `ridgefill_runtime.fill.corpus.calibration_and_heldout()`
({f["n_train_docs"]} documents, {f["train_tokens"]:,} tokens); held-out losses use its held-out split
({f["n_held_docs"]} documents, disjoint by content hash). The kernel documentation is GPL-2.0
licensed text; treat these weights as derived from GPL-2.0 material. The Python documentation
(ridgefill's evaluation text) was not used.

## Tokenizer
Byte-level BPE (`tokenizers`, ByteLevel pre-tokenizer and decoder, no prefix space), vocabulary
{cfg["vocab_size"]}, trained on the same training text. `<|endoftext|>` = id {cfg["eos_token_id"]} is bos,
eos and pad; documents were joined with it. No BOS is added when encoding (`add_bos_token: false`).

## Held-out loss by loop count
{f["eval_tokens"]:,} held-out tokens, same initial state for every row:

{eval_md}

## Training curve
{curve_md}

## How it was trained
Truncated-backprop recurrence as in Huginn: per step, rate ~ LogNormal(ln 12 - 0.125, 0.5),
p = Poisson(rate) + 1 (capped at {MAX_LOOPS}); max(p - 4, 0) loops without gradient, then min(p, 4)
with gradient. AdamW (betas {BETAS}, weight decay {WEIGHT_DECAY} on matrices), lr {LR} with
{WARMUP} warmup steps then cosine to {MIN_LR_FRACTION:g}x, grad clip {GRAD_CLIP}; {f["steps"]} steps of
{BATCH} x {SEQ_LEN} tokens; seed {SEED}; torch {torch.__version__}, {f["threads"]} threads, float32, CPU.

Command (from the repository root):

    {f["command"]}

## Sample
Greedy, {SAMPLE_LOOPS} loops, prompt `{SAMPLE_PROMPT}`, {SAMPLE_TOKENS} new tokens:

```
{sample}
```
"""
    (out / "MODEL_CARD.md").write_text(card)

    bench_md = f"""# Looped (recurrent-depth) model training run

`scripts/train_looped.py` trains the demo checkpoint in `ridgefill_runtime/data/looped/`
(Huginn-0125 layout, {n_params / 1e6:.2f}M parameters) on the kernel documentation.

| what | value |
|---|---|
| command | `{f["command"]}` |
| machine | {f["cpu"]}, {os.cpu_count()} cores |
| torch threads | {f["threads"]} |
| wall time, whole run | {f["wall_s"]:.0f} s ({f["wall_min"]:.1f} min) |
| of which tokenizer training | {f["tok_s"]:.0f} s |
| of which tokenization + windows | {f["data_s"]:.0f} s |
| of which training | {f["train_s"]:.0f} s ({f["train_s"] / f["steps"]:.2f} s/step) |
| of which final eval + sample + save | {f["post_s"]:.0f} s |
| steps | {f["steps"]} |
| batch | {BATCH} x {SEQ_LEN} tokens |
| tokens seen | {f["tokens_seen"]:,} |
| training tokens available | {f["train_tokens"]:,} ({f["train_windows"]:,} windows) |
| mean sampled loop count p | {f["mean_p"]:.2f} |
| final held-out eval | {f["eval_tokens"]:,} tokens |

## Loss curve (every 10% of steps)
Train loss is averaged over the steps since the previous row (each at its own sampled loop count);
held-out loss on {CURVE_EVAL_WINDOWS * SEQ_LEN:,} held-out tokens at {cfg["mean_recurrence"]} loops.

{curve_md}

## Final held-out loss by loop count

{eval_md}

## Sample (greedy, {SAMPLE_LOOPS} loops)

```
{sample}
```
"""
    bench.parent.mkdir(parents=True, exist_ok=True)
    bench.write_text(bench_md)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


# ---------------------------------------------------------------------------------------------


def main() -> None:
    global BATCH, WARMUP
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "ridgefill_runtime/data/looped")
    ap.add_argument("--bench", type=Path, default=REPO / "benchmarks/looped_training.md")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument(
        "--eval-windows",
        type=int,
        default=EVAL_WINDOWS,
        help="held-out windows for the final table (smaller only for a timing probe)",
    )
    ap.add_argument(
        "--log",
        type=Path,
        default=Path("/tmp/train_looped_steps.log"),
        help="per-step log file (loss every ~1%% of steps)",
    )
    args = ap.parse_args()
    # The module constants are the recorded recipe; the flags exist only for timing probes.
    BATCH, WARMUP = args.batch, args.warmup

    t_start = time.time()
    torch.set_num_threads(THREADS)
    torch.manual_seed(SEED)  # nothing should use the global RNG; this is a backstop
    torch.use_deterministic_algorithms(True)
    logf = open(args.log, "w")

    def log(msg: str) -> None:
        line = f"[{time.time() - t_start:7.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    calib, held = calibration_and_heldout()
    train_texts, held_texts = [d.text for d in calib], [d.text for d in held]
    log(f"{len(calib)} training docs, {len(held)} held-out docs")

    tok = train_tokenizer(train_texts, CONFIG["vocab_size"])
    eot = tok.token_to_id(EOT)
    assert tok.get_vocab_size() == CONFIG["vocab_size"], tok.get_vocab_size()
    t_tok = time.time()
    log(f"tokenizer trained: vocab {tok.get_vocab_size()}, {EOT} = {eot}")

    train_rows = windows(token_stream(tok, train_texts), SEQ_LEN)
    held_rows = windows(token_stream(tok, held_texts), SEQ_LEN)
    # Held-out rows spread over the whole split, not just its first documents.
    pick = torch.linspace(0, len(held_rows) - 1, args.eval_windows).round().long()
    curve_pick = torch.linspace(0, len(held_rows) - 1, CURVE_EVAL_WINDOWS).round().long()
    held_eval, held_curve = held_rows[pick], held_rows[curve_pick]
    t_data = time.time()
    log(f"data: {len(train_rows)} train windows, {len(held_rows)} held-out windows of {SEQ_LEN}")

    config = dict(CONFIG, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, torch_dtype="float32")
    model = RavenLM(config)
    model.init_weights(torch.Generator().manual_seed(SEED))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters")
    opt = make_optimizer(model)
    model.train()
    history, curve = train(model, opt, train_rows, held_curve, args.steps, log, torch.Generator().manual_seed(SEED + 1))
    t_train = time.time()

    model.eval()
    eval_table = []
    for r in EVAL_LOOPS:
        eval_table.append((r, heldout_loss(model, held_eval, r, seed=SEED + 9)))
        log(f"held-out loss @ {r} loops: {eval_table[-1][1]:.4f}")
    sample = greedy_sample(model, tok, SAMPLE_PROMPT, SAMPLE_TOKENS, SAMPLE_LOOPS, seed=SEED + 11)
    log(f"sample: {sample!r}")
    save_folder(args.out, model, tok, config)
    check_reload(args.out, model, held_eval)
    t_end = time.time()

    facts = {
        "command": "python " + " ".join(sys.argv),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "n_params": n_params,
        "steps": args.steps,
        "tokens_seen": args.steps * BATCH * SEQ_LEN,
        "train_tokens": int(train_rows.numel() - len(train_rows)),
        "train_windows": len(train_rows),
        "n_train_docs": len(calib),
        "n_held_docs": len(held),
        "eval_tokens": int(held_eval.shape[0] * SEQ_LEN),
        "mean_p": sum(h[2] for h in history) / len(history),
        "tok_s": t_tok - t_start,
        "data_s": t_data - t_tok,
        "train_s": t_train - t_data,
        "post_s": t_end - t_train,
        "wall_s": t_end - t_start,
        "wall_min": (t_end - t_start) / 60,
    }
    write_reports(args.out, args.bench, facts, curve, eval_table, sample, config)
    log(f"done in {facts['wall_s']:.0f}s; wrote {args.out} and {args.bench}")
    json.dump(
        {"facts": facts, "curve": curve, "eval": eval_table, "sample": sample, "history": history},
        open(args.log.with_suffix(".json"), "w"),
    )


if __name__ == "__main__":
    main()
