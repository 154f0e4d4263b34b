"""Token rules for exact rows (fill/rules.py, fill/tokens.py) on crafted prompts, tokenized by the
embedded SmolLM2 GGUF's own tokenizer, and on small crafted vocabularies where a case needs
pieces that tokenizer does not produce (CJK punctuation split into bytes, other templates)."""

from __future__ import annotations

import json
import random
import re
import time
import unicodedata

import gguf
import pytest

from ridgefill_runtime.fill import rules
from ridgefill_runtime.fill.settings import SHIPPED_DIR
from ridgefill_runtime.fill.tokens import (
    ELIGIBLE_CLASSES,
    TokenTable,
    is_digit_token,
    load_counts,
    load_counts_document,
    save_counts,
    token_class,
)
from ridgefill_runtime.loader.gguf import default_model_path
from ridgefill_runtime.loader.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    # As tests/loader/test_tokenizer.py: the tokenizer alone, without converting the weights.
    return Tokenizer.from_gguf_metadata(gguf.GGUFReader(str(default_model_path())))


@pytest.fixture(scope="module")
def table(tokenizer):
    return TokenTable.from_tokenizer(tokenizer)


def chat_ids(tokenizer, user_text: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True)
    return tokenizer.encode(text)


def token_span(table, ids, text: str, occurrence: int = 0) -> tuple[int, int]:
    """Token range [lo, hi) whose pieces cover the given occurrence of `text` in the prompt,
    found from character offsets (independently of rules.sentences)."""
    joined = "".join(table.pieces[i] for i in ids)
    starts = [m.start() for m in re.finditer(re.escape(text), joined)]
    a = starts[occurrence]
    b = a + len(text)
    offset, lo, hi = 0, None, None
    for p, i in enumerate(ids):
        piece_end = offset + len(table.pieces[i])
        if lo is None and piece_end > a:
            lo = p
        if piece_end >= b:
            hi = p + 1
            break
        offset = piece_end
    return lo, hi


def crafted(pieces: list[str], special: set[int], counts=None) -> TokenTable:
    return TokenTable(tuple(pieces), frozenset(special), counts)


# -- the token table -----------------------------------------------------------------------------


def test_table_from_tokenizer(tokenizer):
    t0 = time.perf_counter()
    table = TokenTable.from_tokenizer(tokenizer)
    assert time.perf_counter() - t0 < 2.0
    assert len(table.pieces) == tokenizer.vocab_size == 49152
    # SmolLM2: ids 0..16 are its control tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...).
    assert table.special == frozenset(range(17))
    assert table.pieces[1] == "<|im_start|>" and table.counts is None
    text = "Plain ASCII text, 42 words."
    assert "".join(table.pieces[i] for i in tokenizer.encode(text)) == text
    with pytest.raises(ValueError, match="counts has 3 entries"):
        TokenTable.from_tokenizer(tokenizer, counts=[1, 2, 3])


@pytest.mark.parametrize(
    "piece, prev, expected",
    [
        ("Vault", None, "cap_start"),  # first token of the text
        (" Vault", "the", "cap_start"),  # leading whitespace
        ("NASA", "(", "cap_start"),  # previous text does not end in a letter
        ("LM", "ol", "cap_piece"),  # "Sm" "ol" "LM"
        ("É", "caf", "cap_piece"),  # non-ASCII capital
        (" vault", "the", "lower_start"),
        ("vault", "-", "lower_start"),
        (" 日本", None, "lower_start"),  # letters without case count as lower-case
        ("ugging", " H", "lower_piece"),
        ("日本", "x", "lower_piece"),
        ("7731", " ", "number"),
        (" 3", "x", "number"),
        ("3.", "x", "number"),  # digits with punctuation
        ("-42", "x", "number"),
        (",", "x", "punct"),
        (".\n", "x", "punct"),  # whitespace never decides a class
        ("\ufffd", "x", "punct"),  # a lone byte of a multi-byte character
        ("\n\n", "x", "space"),
        ("", "x", "space"),
        ("'s", "it", "mixed"),
        ("x2", " ", "mixed"),
        ("_id", "x", "mixed"),
        ("½", " ", "mixed"),  # a number character that is not a decimal digit
    ],
)
def test_token_class(piece, prev, expected):
    assert token_class(piece, prev) == expected


def test_is_digit_token():
    assert is_digit_token("7") and is_digit_token("B12") and is_digit_token("٣") and is_digit_token("７")
    assert not is_digit_token("½") and not is_digit_token("seven") and not is_digit_token("")


# -- always-exact rows ---------------------------------------------------------------------------


def test_special_rows_include_position_zero_and_every_special(tokenizer, table):
    ids = chat_ids(tokenizer, "Tell me about vaults.")
    expected = sorted({0} | {p for p, i in enumerate(ids) if i in range(17)})
    assert rules.special_rows(ids, table, len(ids)) == expected
    # Only positions < end.
    cut = expected[2]
    assert rules.special_rows(ids, table, cut) == [p for p in expected if p < cut]
    # Position 0 even when it holds an ordinary token; nothing for an empty prefix.
    plain = tokenizer.encode("Hello there<|im_end|> and more")
    assert table.pieces[plain[0]] == "Hello"
    assert rules.special_rows(plain, table, len(plain)) == [0, plain.index(2)]
    assert rules.special_rows(plain, table, 0) == []


def test_digit_rows(tokenizer, table):
    ids = tokenizer.encode("Call 555-0199 at 3.14 o'clock, room B12.")
    rows = rules.digit_rows(ids, table, len(ids))
    assert [table.pieces[ids[p]] for p in rows] == list("555019931412")
    assert rows == [p for p, i in enumerate(ids) if any(c.isdigit() for c in table.pieces[i])]
    assert rules.digit_rows(ids, table, rows[3]) == rows[:3]


# -- protected tokens ----------------------------------------------------------------------------

PROTECTED_TEXT = (
    "The Kestrel-9 relay in Brisbane uses firmware v2.7b from McAllister Labs; its checksum is "
    "0xDEADBEEF and the operator, Dr. Okonkwo-Vance, logs every reboot at the Zürich office. "
    "Unusual tokens like qwfprt, _internal_flag and SmolLM's naming appear here too."
)


def brute_force_protected(ids, table, end, share_num, share_den):
    """Rank-based, sort-free: a row is picked when fewer than k eligible rows beat it."""
    eligible = [
        p
        for p in range(end)
        if ids[p] not in table.special
        and token_class(table.pieces[ids[p]], table.pieces[ids[p - 1]] if p else None) in ELIGIBLE_CLASSES
    ]
    k = -(-len(eligible) * share_num // share_den)  # ceil
    key = {p: (table.counts[ids[p]] + 1, p) for p in eligible}
    return {p for p in eligible if sum(key[q] < key[p] for q in eligible) < k}, eligible


def test_protected_rows_pick_the_rarest_quarter(tokenizer, table):
    ids = chat_ids(tokenizer, PROTECTED_TEXT)
    rng = random.Random(7)
    # Few distinct values, so ties (broken by position) are common.
    counts = tuple(rng.randrange(0, 6) for _ in range(len(table.pieces)))
    counted = table.with_counts(counts)
    got = rules.protected_rows(ids, counted, len(ids))
    expected, eligible = brute_force_protected(ids, counted, len(ids), 1, 4)
    assert len(eligible) >= 20 and got == sorted(expected)
    assert len(got) == -(-len(eligible) // 4)
    for p in got:
        assert ids[p] not in table.special
        prev = table.pieces[ids[p - 1]] if p else None
        assert token_class(table.pieces[ids[p]], prev) not in {"lower_start", "number", "punct", "space"}
    # Another share and a shorter prefix.
    end = len(ids) // 2
    expected, _ = brute_force_protected(ids, counted, end, 1, 10)
    assert rules.protected_rows(ids, counted, end, share=0.1) == sorted(expected)
    # All counts equal: the earliest eligible rows win.
    flat = table.with_counts([3] * len(table.pieces))
    k = -(-len(eligible) // 4)
    assert rules.protected_rows(ids, flat, len(ids)) == eligible[:k]
    assert rules.protected_rows(ids, counted, len(ids), share=0.0) == []


def test_protected_rows_need_counts(tokenizer, table):
    ids = tokenizer.encode("Hello World")
    with pytest.raises(ValueError, match="counts"):
        rules.protected_rows(ids, table, len(ids))


# -- words and sentences -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The CODES Vault", ["the", "code", "vault"]),
        ("class gas bus Bus BUSES glass Process", ["class", "gas", "bus", "bus", "buse", "glass", "process"]),
        ("its this ALWAYS", ["its", "thi", "alway"]),  # final s only from words of 4+ characters
        ("ÄPFEL Straße ÉCOLE", ["Äpfel", "straße", "École"]),  # only ASCII letters are lower-cased
        ("ΣΟΦΙΑ", ["ΣΟΦΙΑ"]),
        ("foo_bar snake_case_names", ["foo", "bar", "snake", "case", "name"]),
        ("XK-7731-QZ e.g. x2y", ["xk", "7731", "qz", "e", "g", "x2y"]),
        ("nai\u0308ve café", ["nai", "ve", "café"]),  # combining marks separate words
        ("日本語のテキスト。次！", ["日本語のテキスト", "次"]),
        ("１２３ ½", ["１２３", "½"]),  # number characters, kept as they are
    ],
)
def test_words_normalization(text, expected):
    assert [w for w, _, _ in rules.words(text)] == expected


def test_words_offsets():
    assert rules.words("ab_cd, Eggs!") == [("ab", 0, 2), ("cd", 3, 5), ("egg", 7, 11)]


def test_word_characters_are_letters_and_numbers():
    # The regex stands for Unicode categories L* and N*; check it on a slice of the BMP.
    for cp in list(range(0x20, 0x3000)) + list(range(0xFF00, 0xFFF0)):
        ch = chr(cp)
        assert bool(rules.words(ch)) == (unicodedata.category(ch)[0] in "LN"), hex(cp)


def sentence_texts(table, ids, end):
    return ["".join(table.pieces[i] for i in ids[a:b]) for a, b in rules.sentences(ids, table, end)]


def test_sentences_real_tokenizer(tokenizer, table):
    ids = tokenizer.encode("First one. Second one! Third? Pi is 3.14 here.\nLine two<|endoftext|>After it。Next")
    assert sentence_texts(table, ids, len(ids)) == [
        "First one.",
        " Second one!",
        " Third?",
        " Pi is 3.14 here.",
        "\n",
        "Line two",
        "After it。",
        "Next",
    ]
    spans = rules.sentences(ids, table, len(ids))
    special = ids.index(0)
    assert all(not (a <= special < b) for a, b in spans)  # the special token belongs to none
    # Positions < end only; the open sentence is closed at end.
    assert rules.sentences(ids, table, 5) == [(0, 3), (3, 5)]


def test_sentences_cjk_ends_and_specials():
    pieces = ["<s>", "日本", "。", "次", "！", "本当", "？", "終", "\uff61", "x", "<unk>", "y", "?", "z"]
    table = crafted(pieces, {0, 10})
    ids = list(range(len(pieces)))
    assert rules.sentences(ids, table, len(ids)) == [(1, 3), (3, 5), (5, 7), (7, 9), (9, 10), (11, 14)]
    # "?" directly followed by a letter does not end a sentence; followed by a special it does.
    ids2 = [9, 12, 13, 12, 10, 11]
    assert rules.sentences(ids2, table, len(ids2)) == [(0, 4), (5, 6)]


# -- the content window --------------------------------------------------------------------------


def chatml_template_positions(table, ids):
    """Specials, the role line after <|im_start|>, and the newline after <|im_end|>."""
    out = set()
    for p, i in enumerate(ids):
        if i in (1, 2):
            out.add(p)
            q = p + 1
            while q < len(ids) and "\n" not in table.pieces[ids[q]]:
                out.add(q)
                q += 1
            out.add(q)
    return out


def test_content_window_skips_chatml_template(tokenizer, table):
    ids = chat_ids(tokenizer, "Some document text goes here.\n\nWhat is the access code for the blue vault?")
    template = chatml_template_positions(table, ids)
    content = [p for p in range(len(ids)) if p not in template]
    for n in (5, 20, 64):
        window = rules.content_window(ids, table, len(ids), n)
        assert window == content[-n:]
    window = rules.content_window(ids, table, len(ids), 64)
    pieces = [table.pieces[ids[p]] for p in window]
    assert pieces[-1] == "?"  # the end of the user's turn, not the assistant header
    assert not any(ids[p] in table.special for p in window)
    assert "user" not in pieces and "istant" not in pieces and "system" not in pieces
    # window_end cuts the prompt: only positions before it.
    cut = ids.index(2, ids.index(2) + 1)  # the user's <|im_end|>
    assert rules.content_window(ids, table, cut, 5) == content[-5:]
    assert rules.content_window(ids, table, 0, 5) == []


def test_content_window_other_templates():
    # Mistral-like: text follows a control token on the same line, so it is content.
    table = crafted(["[INST]", " What", " is", " it", "?", "[/INST]", "<|end_header_id|>", "\n\n", "user"], {0, 5, 6})
    assert rules.content_window([0, 1, 2, 3, 4, 5], table, 6) == [1, 2, 3, 4]
    # Llama-3-like: the blank line after <|end_header_id|> is template.
    assert rules.content_window([6, 7, 1, 2, 3, 4, 0, 8], table, 6) == [2, 3, 4, 5]


# -- the lexical net -----------------------------------------------------------------------------

PLANTED = " The access code for the blue vault is XK-7731-QZ."
QUESTION = "What is the access code for the blue vault?"


def filler_sentences(count: int) -> list[str]:
    """Sentences that share the question's common words (and 4-word runs of them) but no rare
    word: every word recurs at least three times."""
    places = ["gym", "lab", "pool", "roof"]
    things = ["office", "garage", "kitchen"]
    out = []
    for k in range(count):
        place, thing = places[k % len(places)], things[k % len(things)]
        if k % 2:
            out.append(f" Ask the front desk for the access code for the {place}.")
        else:
            out.append(f" The code for the {thing} is kept in the {place} by the staff.")
    return out


def vault_prompt(tokenizer, planted_at: int = 15, extra: str = ""):
    fillers = filler_sentences(40)
    # "blue" also occurs once more, far from the question and in no shared 4-word run.
    body = " The sky was blue." + "".join(fillers[:planted_at]) + PLANTED + extra + "".join(fillers[planted_at:])
    return chat_ids(tokenizer, body.strip() + "\n\n" + QUESTION)


def test_lexical_picks_the_planted_sentence(tokenizer, table):
    ids = vault_prompt(tokenizer)
    end = token_span(table, ids, QUESTION)[0]  # the question itself is past the prefix
    lo, hi = token_span(table, ids, PLANTED)
    assert hi - lo <= 0.05 * end  # the total cap does not bind here
    assert rules.lexical_rows(ids, table, end, len(ids)) == list(range(lo, hi))
    # Without the rare words the common 4-word runs ("the access code for the") keep nothing.
    assert rules.lexical_rows(ids, table, end, len(ids), max_occurrences=0) == []
    # A longer required run than the shared one keeps nothing either.
    assert rules.lexical_rows(ids, table, end, len(ids), min_run=8) == []
    # When the window overlaps the prefix (a tail shorter than the window), the question's own
    # sentence matches itself: the rule as written keeps it too.
    q_lo, q_hi = token_span(table, ids, QUESTION)
    assert rules.lexical_rows(ids, table, len(ids), len(ids), cap_share=1.0) == [*range(lo, hi), *range(q_lo, q_hi)]


def test_lexical_keeps_the_first_80_rows_of_a_long_sentence(tokenizer, table):
    tail = " and then " + " ".join(f"item{k} stays" for k in range(60))
    long_planted = PLANTED[:-1] + tail + "."
    ids = chat_ids(
        tokenizer,
        "".join(filler_sentences(20)).strip() + long_planted + "".join(filler_sentences(20)) + "\n\n" + QUESTION,
    )
    end = token_span(table, ids, QUESTION)[0]
    lo, hi = token_span(table, ids, long_planted)
    assert hi - lo > 80
    assert rules.lexical_rows(ids, table, end, len(ids), cap_share=1.0) == list(range(lo, lo + 80))
    assert rules.lexical_rows(ids, table, end, len(ids), cap_share=1.0, sentence_rows=30) == list(range(lo, lo + 30))


COLOURS = ["amber", "bronze", "cobalt", "denim", "ebony", "fuchsia", "garnet", "hazel"]


def test_lexical_total_cap_rarest_first(tokenizer, table):
    # Every planted sentence shares "the <colour> key word" with the question; amber and bronze
    # also occur once elsewhere (prefix count 2), so they rank after the count-1 colours although
    # they come first in the text.
    planted = [f" We wrote the {c} key word on a card." for c in COLOURS]
    body = (
        "".join(filler_sentences(16))
        + "".join(planted)
        + " An amber cat and a bronze hat sat."
        + "".join(filler_sentences(16))
    )
    question = "Recall " + ", ".join(f"the {c} key word" for c in COLOURS) + "?"
    ids = chat_ids(tokenizer, body.strip() + "\n\n" + question)
    end = token_span(table, ids, question)[0]
    spans = [token_span(table, ids, s) for s in planted]
    window = rules.content_window(ids, table, len(ids))
    assert window[0] < token_span(table, ids, question)[1] - 40  # the window holds the question

    cap = int(0.05 * end)
    matched_rows = sum(hi - lo for lo, hi in spans)
    assert matched_rows > cap  # the cap binds
    rows = rules.lexical_rows(ids, table, end, len(ids))
    assert len(rows) == cap <= 0.05 * end

    rank = {c: (2 if c in ("amber", "bronze") else 1) for c in COLOURS}
    order = sorted(range(len(COLOURS)), key=lambda k: (rank[COLOURS[k]], spans[k][0]))
    expected, left = [], cap
    for k in order:
        lo, hi = spans[k]
        take = min(hi - lo, 80, left)
        expected += range(lo, lo + take)
        left -= take
    assert rows == sorted(expected)
    assert spans[0][0] not in rows and spans[2][0] in rows  # rarest first, not first in the text
    # Without the cap every planted sentence is kept whole, and nothing else.
    assert rules.lexical_rows(ids, table, end, len(ids), cap_share=1.0) == sorted(
        p for lo, hi in spans for p in range(lo, hi)
    )


def test_lexical_empty_cases(tokenizer, table):
    ids = chat_ids(tokenizer, QUESTION)
    assert rules.lexical_rows(ids, table, 0, len(ids)) == []
    assert rules.lexical_rows(ids, table, len(ids), 0) == []


# -- unigram counts ------------------------------------------------------------------------------


def test_counts_round_trip(tmp_path):
    path = save_counts(tmp_path / "c.json", [0, 5, 2], {"documents": 1})
    assert load_counts(path) == (0, 5, 2)
    path.write_text(json.dumps({"format": "ridgefill-unigram/1", "vocab_size": 4, "counts": {"1": 7}, "meta": {}}))
    assert load_counts(path) == (0, 7, 0, 0)
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a ridgefill-unigram/1"):
        load_counts(path)


def test_shipped_counts_match_the_fit_manifest():
    path = SHIPPED_DIR / "smollm2-135m-instruct.unigram.json"
    assert path.stat().st_size < 1_000_000
    document = load_counts_document(path)
    manifest = json.loads((SHIPPED_DIR / "manifest.json").read_text())
    meta = document["meta"]
    assert len(document["counts"]) == 49152
    assert sum(document["counts"]) == meta["total_tokens"] == sum(d["tokens"] for d in manifest["calibration"])
    assert meta["documents_sha256"] == [d["sha256"] for d in manifest["calibration"]]
    assert meta["model_identity"] == manifest["model_identity"]
