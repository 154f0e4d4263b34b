"""Next-token choice: greedy, or temperature / top-k / top-p with a per-request generator."""

from __future__ import annotations

import torch

from .ops.row_argmax import row_argmax
from .sequence import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] float32 with everything outside top-k and the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # NOTE: drop a token when the mass strictly before it already reaches top_p. The most
        # likely token always survives, also when top_p underflows float32 to 0 (a top_p of
        # 1e-308 would otherwise drop every token and leave NaN probabilities).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [V] (float32)."""
    if params.greedy:
        return int(row_argmax(logits[None])[0])
    filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = filtered.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
