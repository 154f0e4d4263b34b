"""Next-token choice: greedy, or temperature / top-k / top-p with a per-request generator."""

from __future__ import annotations

import torch

from .ops.row_argmax import row_argmax
from .sequence import SamplingParams

# NOTE: the top-p nucleus is looked for among this many most likely tokens first: sorting all of
# Gemma 3's 262,144 logits took ~22 ms a sampled token on the CPU (more than its decode step), the
# top 1024 ~1 ms. Where their mass reaches top_p, every later token is dropped by the rule anyway,
# so the candidates decide alone; where it does not (a flat distribution), the whole vocabulary is
# sorted.
NUCLEUS_CANDIDATES = 1024


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] float32 with everything outside top-k and the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = logits.masked_fill(_outside_nucleus(logits, top_p), float("-inf"))
    return logits


def _outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool [V]: the tokens whose probability mass strictly before them (most likely first)
    already reaches top_p. The most likely token always stays, also when top_p underflows
    float32 to 0 (a top_p of 1e-308 would otherwise drop every token and leave NaN probabilities)."""
    top, order, mass = _most_likely_first(logits, top_p)
    keep_sorted = mass - top < top_p
    keep_sorted[0] = True
    # every token past the candidates is dropped: the candidates' mass already reached top_p
    return torch.ones_like(logits, dtype=torch.bool).scatter(0, order, ~keep_sorted)


def _most_likely_first(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probabilities, token ids, cumulative mass), most likely first: of the top NUCLEUS_CANDIDATES
    where their mass reaches top_p, else of the whole vocabulary."""
    if NUCLEUS_CANDIDATES < logits.shape[-1]:
        top, order = torch.topk(logits.softmax(-1), NUCLEUS_CANDIDATES)  # [C]
        mass = top.cumsum(-1)  # [C]
        if float(mass[-1]) >= top_p:
            return top, order, mass
    sorted_logits, order = torch.sort(logits, descending=True)
    top = sorted_logits.softmax(-1)  # [V]
    return top, order, top.cumsum(-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [V] (float32)."""
    if params.greedy:
        return int(row_argmax(logits[None])[0])
    filtered = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = filtered.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
