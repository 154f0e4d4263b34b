"""The Gated DeltaNet token mixer of the Qwen3.5 / Qwen3-Next hybrids, over per-sequence state.

Per row: one projection gives the conv input (q, k, v channels), the output gate z, β's logit b
and the decay's input a. q, k, v pass a depthwise causal conv (kernel K, SiLU) whose last K - 1
inputs are the sequence's conv state; then the gated delta rule (ops/gdn.py) with
β = σ(b), g = −exp(A_log)·softplus(a + dt_bias) and L2-normed q, k runs from the sequence's
recurrent state S [Hv, Dk, Dv]; the output passes a gated RMSNorm (norm · silu(z)) and out_proj.

State: every sequence in the step owns a state slot (AttentionBatch.state_slots). A sequence
whose rows start at position 0 (or that AttentionBatch.state_fresh marks) starts from zero state,
whatever the slot holds; any other step continues from the slot, so chunked prefill and decode
carry the state across steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..ops.gdn import gdn_chunk, gdn_step
from .attention import AttentionBatch

if TYPE_CHECKING:
    from ..models.hybrid_config import HybridConfig


@dataclass
class GDNWeights:
    # [C + 2*Hv + Hv*Dv, d]: conv input (q, k, v), then b, then a, then z; z last so that rows
    # that only carry the state (RidgeFill's filled rows) skip its GEMM rows
    in_proj: torch.Tensor
    conv: torch.Tensor  # [C, K] depthwise causal conv taps, oldest input first
    neg_decay: torch.Tensor  # [Hv] float32: −exp(A_log)
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv] gated RMSNorm weight (plain w, not 1 + w)
    out: torch.Tensor  # [d, Hv*Dv]


def state_shapes(cfg: HybridConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What a GDN layer keeps per sequence: the conv's last K - 1 inputs, S, and (during a
    two-sweep prefill) the running gate-product sums the terminal-state correction's ρ reads."""
    return (
        ("conv", (cfg.conv_kernel - 1, cfg.conv_channels)),
        ("ssm", (cfg.value_heads, cfg.key_head_dim, cfg.value_head_dim)),
        ("share", (2, cfg.value_heads)),
    )


def gdn_mixer(
    x: torch.Tensor,
    w: GDNWeights,
    cfg: HybridConfig,
    batch: AttentionBatch,
    state: dict[str, torch.Tensor],
    eps: float,
    out_rows: torch.Tensor | None = None,
    filled: torch.Tensor | None = None,
    history: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Normed layer input [N, d] -> mixer output [N, d] (or [R, d] for `out_rows`: the other rows
    only update the state); writes each sequence's new conv state and S into `state`
    (conv [slots, K-1, C], ssm [slots, Hv, Dk, Dv] float32). With `filled` [N] bool (a
    two-sweep late step) it also carries each sequence's gate-product sums (state["share"]).
    `history` (StatePool.history): where a sequence verifying a speculative draft keeps its
    conv state and S after each row, for the rollback."""
    n = x.shape[0]
    hv, dv = cfg.value_heads, cfg.value_head_dim
    carried = cfg.conv_channels + 2 * hv  # rows of in_proj every row needs; z only the rows with output
    if out_rows is None:
        mixed, b, a, z = F.linear(x, w.in_proj).split([cfg.conv_channels, hv, hv, hv * dv], dim=-1)
    else:
        mixed, b, a = F.linear(x, w.in_proj[:carried]).split([cfg.conv_channels, hv, hv], dim=-1)
        z = F.linear(x[out_rows], w.in_proj[carried:])  # [R, Hv*Dv]
    beta = b.sigmoid()  # [N, Hv]
    g = w.neg_decay * F.softplus(a.float() + w.dt_bias)  # [N, Hv] float32, <= 0
    core = x.new_empty(n, hv, dv)  # [N, Hv, Dv]
    steps, runs = _split_rows(batch)
    if steps:
        _decode_rows(steps, mixed, g, beta, w, cfg, state, core)
    for i, slot, lo, hi, fresh in runs:
        if history is not None and batch.verifies is not None and batch.verifies[i]:
            _verify_rows(slot, lo, hi, mixed, g, beta, w, cfg, state, core, history)
        else:
            _prefill_rows(slot, lo, hi, fresh, mixed, g, beta, w, cfg, state, core)
    if filled is not None:
        _carry_share(state["share"], g, filled, steps, runs)
    if out_rows is not None:
        core = core[out_rows]
    z = z.view(core.shape[0], hv, dv)
    return F.linear(gated_rms_norm(core, z, w.norm, eps).reshape(core.shape[0], hv * dv), w.out)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, times the weight in x's dtype, times silu(gate) in float32."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


def _split_rows(batch: AttentionBatch):
    """Sequences with one row continuing a history (decode) go through one batched step;
    the others (prefill chunks, one-token prompts) run their own scan.
    Returns ([(slot, row)], [(sequence, slot, lo, hi, fresh)])."""
    slots = batch.state_slots
    if slots is None:
        if batch.num_seqs > 1:
            raise ValueError("a Gated DeltaNet layer needs a state slot per sequence")
        slots = [0] * batch.num_seqs
    steps, runs = [], []
    for i, slot in enumerate(slots):
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        if hi == lo:
            continue
        # NOTE: rows are taken in the order given, which is position order (a late sweep's
        # scattered rows included); by default the state starts afresh at position 0.
        fresh = batch.state_fresh[i] if batch.state_fresh is not None else batch.context_lens[i] == hi - lo
        if hi - lo == 1 and not fresh:
            steps.append((slot, lo))
        else:
            runs.append((i, slot, lo, hi, fresh))
    return steps, runs


def _verify_rows(slot, lo, hi, mixed, g, beta, w, cfg, state, core, history) -> None:
    """A decode with a draft: the rows one at a time, exactly as decode steps would run them
    (so accepted tokens are the ones plain decoding picks), keeping the states after each."""
    conv_state, ssm = state["conv"], state["ssm"]
    width = conv_state.shape[1]  # K - 1
    conv_in = torch.cat([conv_state[slot].to(mixed.dtype), mixed[lo:hi]])  # [K-1+n, C]
    s = ssm[slot : slot + 1]
    for j in range(hi - lo):
        window = conv_in[j : j + width + 1]  # [K, C]: the row and its K-1 predecessors
        q, k, v = _split_qkv(F.silu((window * w.conv.T).sum(0))[None], cfg)
        o, s = gdn_step(q, k, v, g[lo + j : lo + j + 1], beta[lo + j : lo + j + 1], s, use_qk_l2norm=True)
        core[lo + j] = o[0]
        history["conv"][slot, j] = window[1:]
        history["ssm"][slot, j] = s[0]
    conv_state[slot] = conv_in[conv_in.shape[0] - width :]
    ssm[slot] = s[0]


def share_update(share: torch.Tensor, g: torch.Tensor, filled: torch.Tensor) -> torch.Tensor:
    """share [2, Hv] (Σ_j w_j over all rows so far, over filled rows) after rows with log-gates
    g [n, Hv] (each <= 0), filled [n] bool -> the new share [2, Hv]. float32 in, float32 out;
    the sums are formed in float64. NOTE: the terminal-state correction's running sums
    (fill/terminal_state.py); they live here as only the mixer sees the gates."""
    g64 = g.double()
    cum = g64.cumsum(0)  # [n, Hv]
    weights = (cum[-1:] - cum).exp()  # [n, Hv]: the gates after each row, to the chunk's end
    decay = cum[-1].exp()  # [Hv]
    new_all = share[0].double() * decay + weights.sum(0)
    new_filled = share[1].double() * decay + (weights * filled[:, None].double()).sum(0)
    return torch.stack([new_all, new_filled]).to(share.dtype)


def _carry_share(share: torch.Tensor, g: torch.Tensor, filled: torch.Tensor, steps, runs) -> None:
    """share [slots, 2, Hv] after this step's rows (see fill/terminal_state.py)."""
    for slot, row in steps:
        share[slot] = share_update(share[slot], g[row : row + 1], filled[row : row + 1])
    for _, slot, lo, hi, fresh in runs:
        share[slot] = share_update(torch.zeros_like(share[slot]) if fresh else share[slot], g[lo:hi], filled[lo:hi])


def _split_qkv(y: torch.Tensor, cfg: HybridConfig):
    """Conv output [..., C] -> q, k [..., Hk, Dk], v [..., Hv, Dv]."""
    kd = cfg.key_heads * cfg.key_head_dim
    q, k, v = y.split([kd, kd, cfg.value_heads * cfg.value_head_dim], dim=-1)
    lead = y.shape[:-1]
    return (
        q.reshape(*lead, cfg.key_heads, cfg.key_head_dim),
        k.reshape(*lead, cfg.key_heads, cfg.key_head_dim),
        v.reshape(*lead, cfg.value_heads, cfg.value_head_dim),
    )


def _prefill_rows(slot, lo, hi, fresh, mixed, g, beta, w, cfg, state, core) -> None:
    conv_state, ssm = state["conv"], state["ssm"]
    history = mixed.new_zeros(conv_state.shape[1:]) if fresh else conv_state[slot].to(mixed.dtype)
    conv_in = torch.cat([history, mixed[lo:hi]])  # [K-1+n, C]
    conv_state[slot] = conv_in[conv_in.shape[0] - conv_state.shape[1] :]
    # depthwise conv over time: [1, C, K-1+n] -> [1, C, n]
    y = F.silu(F.conv1d(conv_in.T[None], w.conv[:, None, :], groups=w.conv.shape[0]))[0].T  # [n, C]
    q, k, v = _split_qkv(y, cfg)
    o, s = gdn_chunk(
        q[None],
        k[None],
        v[None],
        g[None, lo:hi],
        beta[None, lo:hi],
        None if fresh else ssm[slot : slot + 1],
        use_qk_l2norm=True,
    )
    ssm[slot] = s[0]
    core[lo:hi] = o[0]


def _decode_rows(steps, mixed, g, beta, w, cfg, state, core) -> None:
    conv_state, ssm = state["conv"], state["ssm"]
    slots = torch.tensor([s for s, _ in steps], device=mixed.device)
    rows = torch.tensor([r for _, r in steps], device=mixed.device)
    conv_in = torch.cat([conv_state[slots].to(mixed.dtype), mixed[rows, None]], dim=1)  # [B, K, C]
    conv_state[slots] = conv_in[:, 1:].to(conv_state.dtype)
    y = F.silu((conv_in * w.conv.T[None]).sum(1))  # [B, C]
    q, k, v = _split_qkv(y, cfg)
    o, s = gdn_step(q, k, v, g[rows], beta[rows], ssm[slots], use_qk_l2norm=True)
    ssm[slots] = s
    core[rows] = o
