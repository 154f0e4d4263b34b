"""`ridgefill tune`'s picture: speedup against the budget's value for every candidate, the
frontier, the budget's limit and the chosen point."""

from __future__ import annotations

import math
from pathlib import Path

from .tune import Budget, Measured, frontier


def draw_frontier(measured: list[Measured], budget: Budget, chosen: Measured | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only, no display (servers, tests)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    rated = [m for m in measured if not math.isnan(budget.value(m.quality))]
    ax.scatter(
        [budget.value(m.quality) for m in rated], [m.speedup for m in rated], s=18, color="0.45", label="candidates"
    )
    for m in rated:
        ax.annotate(
            m.candidate.name,
            (budget.value(m.quality), m.speedup),
            fontsize=6,
            xytext=(3, 2),
            textcoords="offset points",
        )
    line = frontier(measured, budget)
    if line:
        ax.plot(
            [budget.value(m.quality) for m in line],
            [m.speedup for m in line],
            "-o",
            markersize=3,
            color="tab:blue",
            label="frontier",
        )
    ax.axvline(budget.limit, color="tab:red", linestyle="--", linewidth=1, label=f"--{budget.option} {budget.limit:g}")
    if chosen is not None:
        ax.scatter(
            [budget.value(chosen.quality)],
            [chosen.speedup],
            s=120,
            facecolors="none",
            edgecolors="tab:green",
            linewidths=2,
            label=f"chosen: {chosen.candidate.name}",
        )
    ax.axhline(1.0, color="0.7", linewidth=0.8)
    ax.set_xlabel(budget.describes)
    ax.set_ylabel("prefill speedup (exact TTFT / candidate TTFT)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
