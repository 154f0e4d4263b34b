"""How far one arm's log-probs and greedy tokens lie from a reference arm's, over documents: the
measures the *_agreement.py benchmarks print."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Agreement:
    max_dlogp: float  # max |Δ log p(next token)| over every scored position
    mean_dlogp: float
    nll: float  # the arm's own mean -log p(next token), nats
    argmax_agree: int
    positions: int
    divergences: str  # per document: the first greedy token that differs, or "none"


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def agreement(scores: list[dict], ref_scores: list[dict], greedy: list[list[int]], ref_greedy: list[list[int]]):
    """`scores`: LLM.score()'s dicts ({target_logprobs, argmax}) per document; `greedy`: token ids."""
    d, nll, agree, total = [], [], 0, 0
    for mine, ref in zip(scores, ref_scores):
        d += [abs(x - y) for x, y in zip(mine["target_logprobs"], ref["target_logprobs"])]
        nll += [-x for x in mine["target_logprobs"]]
        agree += sum(x == y for x, y in zip(mine["argmax"], ref["argmax"]))
        total += len(ref["argmax"])
    divergences = ", ".join(
        "none" if (i := first_divergence(a, b)) is None else str(i) for a, b in zip(greedy, ref_greedy)
    )
    return Agreement(max(d), statistics.fmean(d), statistics.fmean(nll), agree, total, divergences)
