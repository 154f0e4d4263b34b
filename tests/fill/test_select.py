"""Exact-row selection (seed 000, §2.4, Figure 6): budgets, the probe's count, the controls,
and the special rows' agreement with the rows the map fit leaves out. Plain Python."""

from __future__ import annotations

import math
import random

import pytest

from ridgefill_runtime.config import RowsConfig
from ridgefill_runtime.fill import rules
from ridgefill_runtime.fill.fitting import kept_rows
from ridgefill_runtime.fill.select import RowSelector, top_rows
from ridgefill_runtime.fill.tokens import TokenTable
from ridgefill_runtime.sequence import SamplingParams, Sequence

# a toy vocabulary: 0 control, 1 user-defined, then words, capitalized words, digits
PIECES = ("<s>", "<tool>", " the", " of", " Alpha", "Beta", " 7", "3", " rare", "zz", ".", " Gamma")
SPECIAL = frozenset({0, 1})
COUNTS = (0, 0, 900, 800, 5, 40, 100, 100, 1, 2, 700, 3)
TABLE = TokenTable(PIECES, SPECIAL, COUNTS)
N, TAIL = 400, 100
B = N - TAIL


def prompt(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    ids = [rng.randrange(2, len(PIECES)) for _ in range(N)]
    for p in (57, 180, 299):
        ids[p] = 1  # user-defined tokens in the prefix
    ids[350] = 0  # a control token in the tail: not a prefix row
    return ids


def seq_with(rows: RowsConfig, ids=None, attention=None, probe=None) -> Sequence:
    ids = ids or prompt()
    seq = Sequence(prompt_ids=ids, params=SamplingParams())
    seq.fill.boundary, seq.fill.rows = B, rows
    rng = random.Random(1)
    seq.fill.row_scores = {
        "attention": attention or [rng.random() for _ in range(B)],
        "probe": probe or [rng.random() for _ in range(B)],
    }
    return seq


SPECIAL_ROWS = {0, 57, 180, 299}


def test_special_rows_are_position_zero_and_special_tokens_and_match_the_fit_exclusions():
    ids = prompt()
    assert set(rules.special_rows(ids, TABLE, B)) == SPECIAL_ROWS
    kept = set(kept_rows(ids[:B], SPECIAL).tolist())
    assert kept == set(range(B)) - SPECIAL_ROWS  # what the fit leaves out is what runs exactly


@pytest.mark.parametrize("control", ["none", "random", "tail"])
def test_special_rows_are_always_exact(control):
    for sel in [("special",), ("special", "attention"), ("special", "probe"), ("special", "digits")]:
        rows = RowSelector(TABLE)(seq_with(RowsConfig(selectors=sel, control=control)))
        assert SPECIAL_ROWS <= set(rows) and max(rows) < B


def test_attention_budget_is_the_top_share_outside_special_rows():
    seq = seq_with(RowsConfig(selectors=("special", "attention"), attention_share=0.1))
    rows = set(RowSelector(TABLE)(seq))
    scores = seq.fill.row_scores["attention"]
    expect = sorted((p for p in range(B) if p not in SPECIAL_ROWS), key=lambda p: -scores[p])[: math.ceil(0.1 * B)]
    assert rows == SPECIAL_ROWS | set(expect)


def test_probe_count_is_budget_times_base_rules_and_probe_ranking_fills_it():
    for factor in (0.5, 1.0, 2.0):
        seq = seq_with(RowsConfig(selectors=("special", "probe"), budget_factor=factor))
        ids = seq.prompt_ids
        base = (
            set(rules.protected_rows(ids, TABLE, B, 0.5))
            | set(rules.digit_rows(ids, TABLE, B))
            | top_rows(seq.fill.row_scores["attention"], math.ceil(0.2 * B), set())
        ) - SPECIAL_ROWS
        e = round(factor * len(base))
        rows = set(RowSelector(TABLE)(seq))
        probe = seq.fill.row_scores["probe"]
        expect = sorted((p for p in range(B) if p not in SPECIAL_ROWS), key=lambda p: -probe[p])[:e]
        assert rows == SPECIAL_ROWS | set(expect)


def test_lexical_rows_are_reserved_inside_the_probe_budget(monkeypatch):
    seq = seq_with(RowsConfig(selectors=("special", "probe", "lexical")))
    lexical = {3, 4, 5}
    monkeypatch.setattr(rules, "lexical_rows", lambda *a, **k: sorted(lexical))
    with_lex = set(RowSelector(TABLE)(seq))
    monkeypatch.undo()
    without = set(RowSelector(TABLE)(seq_with(RowsConfig(selectors=("special", "probe")))))
    assert lexical <= with_lex
    assert len(with_lex) == len(without)  # the count is the probe's; lexical rows take part of it


@pytest.mark.parametrize(
    "sel", [("special", "attention"), ("special", "probe"), ("special", "digits"), ("special", "protected")]
)
def test_controls_keep_the_count_exactly(sel):
    chosen = set(RowSelector(TABLE)(seq_with(RowsConfig(selectors=sel))))
    rnd = RowSelector(TABLE)(seq_with(RowsConfig(selectors=sel, control="random", seed=4)))
    tail = RowSelector(TABLE)(seq_with(RowsConfig(selectors=sel, control="tail")))
    assert len(rnd) == len(chosen) == len(tail)
    assert len(set(rnd)) == len(rnd) and max(rnd) < B
    e = len(chosen - SPECIAL_ROWS)
    tail_rows = set(tail) - SPECIAL_ROWS
    assert tail_rows == set([p for p in range(B - 1, -1, -1) if p not in SPECIAL_ROWS][:e])
    assert rnd == RowSelector(TABLE)(seq_with(RowsConfig(selectors=sel, control="random", seed=4)))  # seeded
    assert rnd != RowSelector(TABLE)(seq_with(RowsConfig(selectors=sel, control="random", seed=5)))


def test_single_rule_selectors_take_exactly_their_rule():
    ids = prompt()
    digits = set(RowSelector(TABLE)(seq_with(RowsConfig(selectors=("special", "digits")))))
    assert digits == SPECIAL_ROWS | set(rules.digit_rows(ids, TABLE, B))
    prot = set(RowSelector(TABLE)(seq_with(RowsConfig(selectors=("special", "protected"), protected_share=0.25))))
    assert prot == SPECIAL_ROWS | set(rules.protected_rows(ids, TABLE, B, 0.25))


def test_no_selectors_is_the_plain_fill_and_missing_counts_are_refused():
    assert RowSelector(TABLE)(seq_with(RowsConfig(selectors=()))) == []
    with pytest.raises(ValueError, match="unigram"):
        RowSelector(TokenTable(PIECES, SPECIAL, None))(seq_with(RowsConfig(selectors=("special", "probe"))))
