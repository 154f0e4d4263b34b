"""Per-document measures on the rows a fill arm computes exactly (the tail)."""

from __future__ import annotations

import torch


def novel_mask(ids: list[int], n: int = 8) -> torch.Tensor:
    """[len(ids)] bool: token j is novel when no n-token run containing it appears earlier
    in the sequence (so the model cannot simply copy it)."""
    first_start: dict[tuple[int, ...], int] = {}
    repeated = torch.zeros(len(ids), dtype=torch.bool)
    for s in range(len(ids) - n + 1):
        gram = tuple(ids[s : s + n])
        if gram in first_start:
            repeated[s : s + n] = True
        else:
            first_start[gram] = s
    return ~repeated


def target_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [T, V], targets [T] -> -log p(target) [T] (float64)."""
    return -logits.double().log_softmax(-1).gather(1, targets[:, None])[:, 0]


def kl_and_agreement(exact: torch.Tensor, arm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row KL(exact || arm) [T] and top-1 agreement [T] (bool)."""
    lp, lq = exact.double().log_softmax(-1), arm.double().log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return kl, exact.argmax(-1) == arm.argmax(-1)


def paired_bootstrap(diffs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of per-document differences and its 95% percentile interval (documents resampled)."""
    x = torch.tensor(diffs, dtype=torch.float64)
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(x), (reps, len(x)), generator=g)
    means = x[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(x.mean()), float(lo), float(hi)


def binomial_floor(n: int) -> float:
    """§3.4: n samples cannot rule out a failure rate of up to 1 - 0.05^(1/n) (in points)."""
    return -100.0 * (1 - 0.05 ** (1 / n)) if n else float("nan")
