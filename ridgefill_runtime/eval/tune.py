"""`ridgefill tune`: the search's settings, its candidates, the budget rule and the choice.

A candidate is one (split, tail, exact-row policy). Each is measured against exact in the
same run: quality on held-out documents (eval/run.py's paired measures) and prefill speed
through the engine (eval/tune_measure.py). The budget is read conservatively: the value
compared with the limit is the bound of the paired 95% bootstrap interval on the unsafe side,
the upper bound of a ΔNLL, the lower bound of needle retrieval (there also capped by the
binomial floor of the prompt count, as `ridgefill eval` reports it). Among the candidates
inside the budget the fastest is chosen.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, RidgefillError
from .rows_eval import SELECTOR_SETS

# budget flag -> (metric in the summary, what the bound is, higher is better)
BUDGET_METRICS = {
    "max_novel_dnll": ("dnll_novel", "upper bound of novel-token ΔNLL (nats)", False),
    "max_key_dnll": ("dnll_key", "upper bound of key-token ΔNLL (nats)", False),
    "min_retrieval": ("retrieval", "lower bound of needle retrieval as a fraction of exact's", True),
}
BUDGET_RULE = (
    "the bound of the paired 95% bootstrap interval on the unsafe side (ΔNLL: upper; "
    "retrieval: lower, capped by the binomial floor of the prompt count)"
)


class BudgetError(RidgefillError):
    """No candidate meets the budget; the message names the best value measured."""


@dataclass(frozen=True)
class Budget:
    flag: str  # one of BUDGET_METRICS
    limit: float

    def __post_init__(self) -> None:
        if self.flag not in BUDGET_METRICS:
            raise InputError(f"unknown budget {self.flag!r} (known: {', '.join(BUDGET_METRICS)})")
        if not math.isfinite(self.limit):
            raise InputError(f"--{self.option}: must be a finite number, got {self.limit}")
        if self.higher_is_better and not 0 < self.limit <= 1:
            raise InputError(f"--{self.option}: a fraction of exact's retrieval in (0, 1], got {self.limit}")

    @property
    def option(self) -> str:
        return self.flag.replace("_", "-")

    @property
    def metric(self) -> str:
        return BUDGET_METRICS[self.flag][0]

    @property
    def describes(self) -> str:
        return BUDGET_METRICS[self.flag][1]

    @property
    def higher_is_better(self) -> bool:
        return BUDGET_METRICS[self.flag][2]

    def value(self, summary: dict) -> float:
        """The budget's bound for one candidate's summary entry (eval/run.py summarize); NaN
        when it was not measured (no key tokens, no needle solved by exact)."""
        if self.metric == "retrieval":
            r = summary.get("retrieval")
            if not r or not r["n"]:
                return math.nan
            return 1.0 + r["lower_bound"] / 100.0  # NOTE: points vs exact on prompts exact solves
        mean, lo, hi, n = summary[self.metric]
        return hi if n else math.nan

    def allows(self, value: float) -> bool:
        if math.isnan(value):
            return False  # NOTE: an unmeasured quality is not inside any budget
        return value >= self.limit if self.higher_is_better else value <= self.limit

    def better(self, a: float, b: float) -> bool:
        """a is a better quality than b (NaN is never better)."""
        if math.isnan(a):
            return False
        return math.isnan(b) or (a > b if self.higher_is_better else a < b)


def budget_of(max_novel_dnll: float | None, max_key_dnll: float | None, min_retrieval: float | None) -> Budget:
    """Exactly one of the three budget flags -> its Budget."""
    given = {
        flag: value
        for flag, value in (
            ("max_novel_dnll", max_novel_dnll),
            ("max_key_dnll", max_key_dnll),
            ("min_retrieval", min_retrieval),
        )
        if value is not None
    }
    if len(given) != 1:
        raise InputError(
            "give exactly one budget: --max-novel-dnll X, --max-key-dnll X or --min-retrieval F"
            + (f" (got {', '.join('--' + f.replace('_', '-') for f in given)})" if given else "")
        )
    ((flag, value),) = given.items()
    return Budget(flag, float(value))


@dataclass(frozen=True)
class TuneSettings:
    """What the search covers and how long the speed prompt is."""

    splits: tuple[int, ...]
    tails: tuple[int, ...]
    rows: tuple[str, ...]  # names of SELECTOR_SETS
    budget: Budget
    length: int  # tokens of the speed prompt
    reps: int = 3  # timed exact/candidate pairs per candidate

    def __post_init__(self) -> None:
        for name in ("splits", "tails", "rows"):
            if not getattr(self, name):
                raise InputError(f"--{name}: give at least one candidate")
        bad = [s for s in self.splits if s < 1]
        if bad:
            raise InputError(f"--splits: {bad[0]} is not a late layer (>= 1)")
        bad = [t for t in self.tails if t < 1]
        if bad:
            raise InputError(f"--tails: {bad[0]} must be >= 1 (the last prompt row is always exact)")
        unknown = [r for r in self.rows if r not in SELECTOR_SETS]
        if unknown:
            raise InputError(f"--rows: unknown policy {unknown[0]!r} (known: {', '.join(SELECTOR_SETS)})")
        if self.length <= max(self.tails):
            raise InputError(
                f"--length {self.length} must exceed the longest tail ({max(self.tails)}): "
                "a prompt no longer than the tail is never filled"
            )
        if self.reps < 1:
            raise InputError(f"--reps must be >= 1, got {self.reps}")

    def check_layers(self, num_layers: int) -> None:
        bad = [s for s in self.splits if not 0 < s < num_layers]
        if bad:
            raise InputError(f"--splits: {bad[0]} is not a layer in 1..{num_layers - 1}")

    def candidates(self) -> list[Candidate]:
        return [Candidate(s, t, r) for s in self.splits for t in self.tails for r in self.rows]


@dataclass(frozen=True)
class Candidate:
    split: int
    tail: int
    rows: str  # a SELECTOR_SETS name

    @property
    def name(self) -> str:
        return f"s{self.split}-t{self.tail}-{self.rows}"

    @property
    def selectors(self) -> tuple[str, ...]:
        return SELECTOR_SETS[self.rows]


@dataclass(frozen=True)
class Measured:
    """One candidate's measurements: quality (its summarize entry) and speed."""

    candidate: Candidate
    quality: dict
    exact_s: float  # median time to first token, exact
    fill_s: float  # the same for the candidate, interleaved with exact's runs

    @property
    def speedup(self) -> float:
        return self.exact_s / self.fill_s


def choose(measured: list[Measured], budget: Budget) -> Measured:
    """The fastest candidate inside the budget (ties: the better quality); BudgetError naming
    the best value reached when none is inside."""
    inside = [m for m in measured if budget.allows(budget.value(m.quality))]
    if inside:
        fastest = max(m.speedup for m in inside)
        tied = [m for m in inside if m.speedup == fastest]
        return min(tied, key=lambda m: budget.value(m.quality) * (-1 if budget.higher_is_better else 1))
    best = None
    for m in measured:
        if best is None or budget.better(budget.value(m.quality), budget.value(best.quality)):
            best = m
    value = budget.value(best.quality) if best else math.nan
    reached = "nothing was measured" if math.isnan(value) else f"the best is {value:.4g} ({best.candidate.name})"
    raise BudgetError(f"no candidate meets --{budget.option} {budget.limit:g}: {budget.describes}; {reached}")


def frontier(measured: list[Measured], budget: Budget) -> list[Measured]:
    """The candidates no other beats on both speed and the budget's value, best quality first."""
    rated = [m for m in measured if not math.isnan(budget.value(m.quality))]
    rated.sort(key=lambda m: (budget.value(m.quality) * (-1 if budget.higher_is_better else 1), -m.speedup))
    out: list[Measured] = []
    for m in rated:
        if not out or m.speedup > out[-1].speedup:
            out.append(m)
    return out


def fill_toml(chosen: Measured, maps: Path, model: str | None, unigram: str | None, note: str) -> str:
    """The chosen setting as a settings file: [fill] (and [model] path when a model was named),
    read by `ridgefill serve | generate | score --config FILE`."""
    c = chosen.candidate
    lines = [f"# {line}" for line in note.splitlines()]
    if model is not None:
        lines += ["", "[model]", f"path = {json.dumps(model)}"]
    lines += [
        "",
        "[fill]",
        'mode = "plain"',
        f"split = {c.split}",
        f"tail = {c.tail}",
        f"maps = {json.dumps(str(maps))}",
        "",
        "[fill.rows]",
        f"selectors = {json.dumps(list(c.selectors))}",
    ]
    if unigram is not None:
        lines.append(f"unigram = {json.dumps(unigram)}")
    return "\n".join(lines) + "\n"
