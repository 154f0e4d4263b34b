"""Which prefix rows run exactly (seed 000, §2.4, Figure 6): the selectors' rules and scores
combined under their budgets, and the evaluation controls. Plain Python, no tensors.

Counts follow Figure 6. Special rows (position 0, control / user-defined / unknown tokens) are
always exact and outside every budget. Without the probe, the enabled selectors' rows are
united. With the probe, the base rules only count E = budget_factor x |rarer half of the
protected-class rows U every digit row U the top base_attention_share by lower-layer
attention|; lexical rows are reserved inside E and the probe's late-layer ranking fills the
rest. A control keeps the count of the non-special rows and changes which rows they are.
"""

from __future__ import annotations

import math
import random

from ..config import RowsConfig
from . import rules
from .tokens import TokenTable


class RowSelector:
    def __init__(self, table: TokenTable | None):
        self.table = table

    def __call__(self, seq) -> list[int]:
        """A sequence past its lower sweep (and probe) -> sorted exact prefix rows."""
        cfg: RowsConfig = seq.fill.rows
        ids, b = seq.prompt_ids, seq.fill.boundary
        if not cfg.selectors:
            return []
        special = self._special(ids, b) if "special" in cfg.selectors else set()
        if set(cfg.selectors) == {"special"}:
            return sorted(special)
        self._need_table(cfg)
        chosen = self._chosen(seq, cfg, special) - special
        if cfg.control == "random":
            chosen = _random_rows(len(chosen), b, special, cfg.seed, ids)
        elif cfg.control == "tail":
            chosen = _tail_rows(len(chosen), b, special)
        return sorted(special | chosen)

    def _chosen(self, seq, cfg: RowsConfig, special: set[int]) -> set[int]:
        ids, b = seq.prompt_ids, seq.fill.boundary
        view_end = seq.fill.hide_from if seq.fill.hide_from is not None else len(ids)
        lexical = set()
        if "lexical" in cfg.selectors:
            lexical = set(
                rules.lexical_rows(
                    ids,
                    self.table,
                    b,
                    view_end,
                    window=cfg.window,
                    sentence_rows=cfg.lexical_sentence_rows,
                    cap_share=cfg.lexical_cap,
                )
            )
        if "probe" in cfg.selectors:
            budget = round(cfg.budget_factor * len(self._base_rows(seq, cfg) - special))
            rest = max(0, budget - len(lexical - special))
            return lexical | top_rows(seq.fill.row_scores["probe"], rest, special | lexical)
        out = set(lexical)
        if "attention" in cfg.selectors:
            out |= top_rows(seq.fill.row_scores["attention"], _share(cfg.attention_share, b), special)
        if "protected" in cfg.selectors:
            out |= set(rules.protected_rows(ids, self.table, b, cfg.protected_share))
        if "digits" in cfg.selectors:
            out |= set(rules.digit_rows(ids, self.table, b))
        return out

    def _special(self, ids, b: int) -> set[int]:
        """Without a token table (a bare model) only position 0, the attention sink, is known."""
        return set(rules.special_rows(ids, self.table, b)) if self.table is not None else {0}

    def _base_rows(self, seq, cfg: RowsConfig) -> set[int]:
        """The base rules whose union sets the probe's count (Figure 6)."""
        ids, b = seq.prompt_ids, seq.fill.boundary
        base = set(rules.protected_rows(ids, self.table, b, 0.5)) | set(rules.digit_rows(ids, self.table, b))
        return base | top_rows(seq.fill.row_scores["attention"], _share(cfg.base_attention_share, b), set())

    def _need_table(self, cfg: RowsConfig) -> None:
        if self.table is None:
            raise ValueError("exact-row selectors need the tokenizer's token table")
        if ({"protected", "probe"} & set(cfg.selectors)) and self.table.counts is None:
            raise ValueError("the protected and probe selectors need unigram counts (fill.rows.unigram)")


def top_rows(scores: list[float], count: int, exclude: set[int]) -> set[int]:
    """The `count` highest-scoring positions outside `exclude` (ties: the earlier position)."""
    order = sorted((p for p in range(len(scores)) if p not in exclude), key=lambda p: (-scores[p], p))
    return set(order[:count])


def _share(share: float, n: int) -> int:
    return math.ceil(share * n)


def _random_rows(count: int, boundary: int, special: set[int], seed: int, ids) -> set[int]:
    """The random-row control: `count` prefix rows drawn uniformly, seeded per prompt."""
    pool = [p for p in range(boundary) if p not in special]
    rng = random.Random(seed * 1_000_003 + hash(tuple(ids[:boundary])))  # NOTE: int tuples hash stably
    return set(rng.sample(pool, min(count, len(pool))))


def _tail_rows(count: int, boundary: int, special: set[int]) -> set[int]:
    """The longer-tail control: the `count` non-special prefix rows just before the tail."""
    out: set[int] = set()
    p = boundary - 1
    while len(out) < count and p >= 0:
        if p not in special:
            out.add(p)
        p -= 1
    return out
