"""Token rules that choose exact rows of the prefix (paper §2.4, Appendix H).

Each rule is a pure function of the prompt's token ids and a `TokenTable`, and returns the sorted
positions (< end, the prefix boundary) it wants computed exactly. Combining the rules, budgets
and the attention-based selectors live elsewhere.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

from .tokens import ELIGIBLE_CLASSES, TokenTable, is_digit_token, token_class

# A role header longer than this (in tokens) without a line break is taken not to be one: some
# templates (Mistral's [INST]) put the user's text right after a control token on the same line,
# and it must stay content.
MAX_ROLE_HEADER = 8

# The characters Python's str.splitlines() breaks at.
LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")
# These end a sentence only when followed by whitespace or the end of the text ("3.14", "e.g"
# and "a.b" stay whole).
LATIN_ENDS = frozenset(".!?")
# CJK full stop (also the half-width form), full-width exclamation and question marks: CJK text
# has no space after them, so they end a sentence on their own.
CJK_ENDS = frozenset("\u3002\uff61\uff01\uff1f")

# Runs of characters that are letters or number characters (Unicode categories L* and N*):
# \w is exactly L*, N* and "_", so excluding "_" leaves the paper's word characters; punctuation,
# underscores and combining marks (M*) separate words.
_WORD = re.compile(r"[^\W_]+")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
# Stands for a special token or a gap in the text built from tokens: no word or "." run crosses it.
_SEPARATOR = "\n"


def _clip(end: int, ids: Sequence[int]) -> int:
    return max(0, min(int(end), len(ids)))


def _share_count(share: float, n: int, round_up: bool) -> int:
    # round() first so that e.g. 0.1 * 30 = 3.0000000000000004 is 3, not 4.
    value = round(share * n, 9)
    return math.ceil(value) if round_up else math.floor(value)


# ---------------------------------------------------------------------------------------------
# Always-exact rows
# ---------------------------------------------------------------------------------------------


def special_rows(ids: Sequence[int], table: TokenTable, end: int) -> list[int]:
    """Position 0 (the attention sink) and every special token: their K/V is not predictable."""
    end = _clip(end, ids)
    return [p for p in range(end) if p == 0 or ids[p] in table.special]


def digit_rows(ids: Sequence[int], table: TokenTable, end: int) -> list[int]:
    """Rows holding a decimal digit: numbers are copied verbatim, so one wrong digit is fatal."""
    end = _clip(end, ids)
    return [p for p in range(end) if ids[p] not in table.special and is_digit_token(table.pieces[ids[p]])]


# ---------------------------------------------------------------------------------------------
# Protected (rare) tokens
# ---------------------------------------------------------------------------------------------


def eligible_rows(ids: Sequence[int], table: TokenTable, end: int) -> list[int]:
    """Rows whose token class may be protected (tokens.ELIGIBLE_CLASSES); never special tokens."""
    end = _clip(end, ids)
    out = []
    for p in range(end):
        if ids[p] in table.special:
            continue
        prev = table.pieces[ids[p - 1]] if p > 0 else None
        if token_class(table.pieces[ids[p]], prev) in ELIGIBLE_CLASSES:
            out.append(p)
    return out


def protected_rows(ids: Sequence[int], table: TokenTable, end: int, share: float = 0.25) -> list[int]:
    """The rarest `share` of the eligible rows (count rounded up), rarity = add-one calibration
    count of the token id, ties to the earlier position."""
    if table.counts is None:
        raise ValueError(
            "protected_rows needs calibration unigram counts: the TokenTable has counts=None "
            "(load them with tokens.load_counts and TokenTable.with_counts)"
        )
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {share}")
    eligible = eligible_rows(ids, table, end)
    k = _share_count(share, len(eligible), round_up=True)
    rarest = sorted(eligible, key=lambda p: (table.counts[ids[p]] + 1, p))[:k]
    return sorted(rarest)


# ---------------------------------------------------------------------------------------------
# Chat-template tokens and the content window
# ---------------------------------------------------------------------------------------------


def _has_line_break(piece: str) -> bool:
    return any(ch in LINE_BREAKS for ch in piece)


def _role_header_end(ids: Sequence[int], table: TokenTable, special_pos: int) -> int:
    """End (exclusive) of the role header after the special token at `special_pos`: the tokens up
    to and including the first one holding a line break ("user" "\\n" after <|im_start|>). No
    header when another special token or MAX_ROLE_HEADER tokens come first."""
    for q in range(special_pos + 1, min(len(ids), special_pos + 1 + MAX_ROLE_HEADER)):
        if ids[q] in table.special:
            break
        if _has_line_break(table.pieces[ids[q]]):
            return q + 1
    return special_pos + 1


def template_mask(ids: Sequence[int], table: TokenTable, end: int) -> list[bool]:
    """True at positions < end that are chat-template tokens: special tokens and role headers.
    Headers are found looking past `end` when needed, since the cut may fall inside one."""
    end = _clip(end, ids)
    mask = [False] * end
    for p in range(end):
        if ids[p] in table.special:
            for q in range(p, min(end, _role_header_end(ids, table, p))):
                mask[q] = True
    return mask


def content_window(ids: Sequence[int], table: TokenTable, window_end: int, n: int = 64) -> list[int]:
    """Positions of the last n content tokens before window_end: in a chat prompt, the end of the
    user's last turn, which is where the question usually is."""
    mask = template_mask(ids, table, window_end)
    out: list[int] = []
    for p in range(len(mask) - 1, -1, -1):
        if len(out) >= n:
            break
        if not mask[p]:
            out.append(p)
    return out[::-1]


# ---------------------------------------------------------------------------------------------
# Words and sentences
# ---------------------------------------------------------------------------------------------


def normalize_word(word: str) -> str:
    """ASCII letters lower-cased (others kept as they are); a final s dropped from words of four
    or more characters unless they end in ss ("codes" -> "code", "class", "gas", "bus" kept)."""
    word = word.translate(_ASCII_LOWER)
    if len(word) >= 4 and word.endswith("s") and not word.endswith("ss"):
        word = word[:-1]
    return word


def words(text: str) -> list[tuple[str, int, int]]:
    """(normalized word, char start, char end) of each word of the text, in order."""
    return [(normalize_word(m.group()), m.start(), m.end()) for m in _WORD.finditer(text)]


@dataclass(frozen=True)
class _Layout:
    """Text of some token positions laid end to end; starts[k] is where segment k begins and
    owners[k] its token position (-1 for a separator)."""

    text: str
    starts: list[int]
    owners: list[int]

    def token_at(self, char: int) -> int:
        # bisect_right skips empty pieces that start at the same offset.
        return self.owners[bisect_right(self.starts, char) - 1]

    def word_tokens(self) -> list[tuple[str, int, int]]:
        """(word, first position, last position) of each word: a word touches every token its
        characters come from."""
        return [(w, self.token_at(a), self.token_at(b - 1)) for w, a, b in words(self.text)]


def _layout(ids: Sequence[int], table: TokenTable, positions: Iterable[int]) -> _Layout:
    """Concatenate the pieces of `positions` (ascending). Special tokens and jumps between
    non-adjacent positions become a separator so that words do not run across them, and the
    text of a control token ("<|im_start|>") never yields words."""
    parts, starts, owners = [], [], []
    offset, prev = 0, None

    def add(text: str, owner: int) -> None:
        nonlocal offset
        parts.append(text)
        starts.append(offset)
        owners.append(owner)
        offset += len(text)

    for p in positions:
        if prev is not None and p != prev + 1:
            add(_SEPARATOR, -1)
        if ids[p] in table.special:
            add(_SEPARATOR, -1)
        else:
            add(table.pieces[ids[p]], p)
        prev = p
    return _Layout("".join(parts), starts, owners)


def _closes_sentence(piece: str, following: str) -> bool:
    """Whether a token's text holds a sentence end; `following` is the text after it ("" at the
    end of the text or before a special token)."""
    for i, ch in enumerate(piece):
        if ch in LINE_BREAKS or ch in CJK_ENDS:
            return True
        if ch in LATIN_ENDS:
            after = piece[i + 1] if i + 1 < len(piece) else following[:1]
            if not after or after.isspace():
                return True
    return False


def sentences(ids: Sequence[int], table: TokenTable, end: int) -> list[tuple[int, int]]:
    """Token ranges [lo, hi) of the sentences of positions < end. A token whose text holds a
    sentence end closes its sentence after itself; a special token closes the open sentence and
    belongs to none."""
    end = _clip(end, ids)
    out, lo = [], 0
    for p in range(end):
        if ids[p] in table.special:
            if lo < p:
                out.append((lo, p))
            lo = p + 1
            continue
        nxt = ids[p + 1] if p + 1 < end else None
        following = "" if nxt is None or nxt in table.special else table.pieces[nxt]
        if _closes_sentence(table.pieces[ids[p]], following):
            out.append((lo, p + 1))
            lo = p + 1
    if lo < end:
        out.append((lo, end))
    return out


# ---------------------------------------------------------------------------------------------
# The lexical net
# ---------------------------------------------------------------------------------------------


def _runs(positions: list[int]) -> list[list[int]]:
    """Split ascending positions into runs of adjacent ones."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _window_grams(ids: Sequence[int], table: TokenTable, window: list[int], size: int) -> set[tuple[str, ...]]:
    """Every run of `size` consecutive words of the window. Runs do not cross a jump in the
    window (template tokens skipped between two turns), so they stay runs of the real text."""
    grams: set[tuple[str, ...]] = set()
    for segment in _runs(window):
        seq = [w for w, _, _ in _layout(ids, table, segment).word_tokens()]
        grams.update(tuple(seq[i : i + size]) for i in range(len(seq) - size + 1))
    return grams


def _sentence_words(prefix_words: list[tuple[str, int, int]], spans: list[tuple[int, int]]) -> list[list[str]]:
    """The words of each sentence, a word going to the sentence of its first token."""
    los = [lo for lo, _ in spans]
    out: list[list[str]] = [[] for _ in spans]
    for word, first, _ in prefix_words:
        k = bisect_right(los, first) - 1
        if k >= 0 and first < spans[k][1]:
            out[k].append(word)
    return out


def _rarest_shared(seq: list[str], grams: set, occurrences: Counter, size: int, max_occurrences: int) -> int | None:
    """Prefix count of the rarest word in a run of >= size words shared with the window that holds
    a rare word; None if there is no such run. Checking runs of exactly `size` words is enough:
    any longer shared run is made of shared runs of `size` words, one of them covering the rare word."""
    best = None
    for i in range(len(seq) - size + 1):
        gram = tuple(seq[i : i + size])
        if gram not in grams:
            continue
        rare = [occurrences[w] for w in gram if occurrences[w] <= max_occurrences]
        if rare and (best is None or min(rare) < best):
            best = min(rare)
    return best


def lexical_rows(
    ids: Sequence[int],
    table: TokenTable,
    end: int,
    window_end: int,
    window: int = 64,
    min_run: int = 4,
    max_occurrences: int = 2,
    sentence_rows: int = 80,
    cap_share: float = 0.05,
) -> list[int]:
    """Rows of the prefix sentences that share a run of >= min_run words, holding a word that
    occurs <= max_occurrences times in the prefix, with the last `window` content tokens before
    window_end. At most the first `sentence_rows` rows of a sentence, `cap_share` of the prefix
    in all.

    A prefix sentence that lies inside the window itself matches its own words, so with
    window_end <= end the question's own sentence can be kept as well; that is the rule as
    written (the question is worth computing exactly).
    """
    end = _clip(end, ids)
    if end == 0 or min_run < 1:
        return []
    prefix_words = _layout(ids, table, range(end)).word_tokens()
    occurrences = Counter(w for w, _, _ in prefix_words)
    grams = _window_grams(ids, table, content_window(ids, table, window_end, window), min_run)
    if not grams:
        return []
    spans = sentences(ids, table, end)
    matches = []  # (rarest shared word's prefix count, lo, hi)
    for (lo, hi), seq in zip(spans, _sentence_words(prefix_words, spans)):
        rarest = _rarest_shared(seq, grams, occurrences, min_run, max_occurrences)
        if rarest is not None:
            matches.append((rarest, lo, hi))
    # When the total cap binds, the sentences with the rarest shared word go first (ties: the
    # earlier sentence). The sentence that would overflow the cap keeps only its first rows, up
    # to what is left: its start (where an identifier usually follows its cue words) is still
    # worth more than nothing. No sentence ever keeps more than its first `sentence_rows` rows.
    budget = _share_count(cap_share, end, round_up=False)
    rows: list[int] = []
    for _, lo, hi in sorted(matches):
        take = min(hi - lo, sentence_rows, budget - len(rows))
        if take <= 0:
            break
        rows.extend(range(lo, lo + take))
    return sorted(rows)
