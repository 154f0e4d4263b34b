"""GrammarBook: specs compiled once and kept by schema, refusals naming the request field, and
what the compiled grammars accept, checked by feeding the embedded tokenizer's own encoding of
strings in and out of the language."""

from __future__ import annotations

import json

import pytest

from ridgefill_runtime.config import StructuredConfig
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.grammar.book import GrammarBook
from ridgefill_runtime.grammar.spec import GrammarSpec, choice_spec, json_schema_spec
from ridgefill_runtime.loader.load import load_checkpoint


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
        return load_checkpoint(None).tokenizer


def accepts(book: GrammarBook, spec: GrammarSpec, tokenizer, text: str) -> bool:
    """Whether the grammar takes `text`, as the tokenizer spells it, as a whole output."""
    m = book.matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_json_schema_accepts_valid_and_refuses_invalid(tokenizer):
    book = GrammarBook(tokenizer, StructuredConfig())
    spec = json_schema_spec(
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}, "required": ["n"]}, "rf"
    )
    assert accepts(book, spec, tokenizer, '{"n": 3}')
    assert not accepts(book, spec, tokenizer, '{"n": -3}')
    assert not accepts(book, spec, tokenizer, '{"m": 3}')
    assert not accepts(book, spec, tokenizer, '{"n": 3')  # not complete


@pytest.mark.parametrize("choices", [["yes", "no"], ['say "hi"', "back\\slash", "naïve ☃"], ["a", "ab", "abc"]])
def test_choice_is_exactly_its_strings(tokenizer, choices):
    book = GrammarBook(tokenizer, StructuredConfig())
    spec = choice_spec(choices, "structured_outputs.choice")
    for c in choices:
        assert accepts(book, spec, tokenizer, c), c
    assert not accepts(book, spec, tokenizer, choices[0] + "x")
    assert not accepts(book, spec, tokenizer, json.dumps(choices[0]))  # the quotes are not part of it


def test_regex_and_lark(tokenizer):
    book = GrammarBook(tokenizer, StructuredConfig())
    date = GrammarSpec("regex", r"\d{4}-\d{2}-\d{2}", "structured_outputs.regex")
    assert accepts(book, date, tokenizer, "2026-12-04") and not accepts(book, date, tokenizer, "2026-1-04")
    lark = GrammarSpec("lark", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]+/\n', "structured_outputs.grammar")
    assert accepts(book, lark, tokenizer, "(1,22,333)") and not accepts(book, lark, tokenizer, "(1,,2)")


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec("regex", "(unclosed", "structured_outputs.regex"), "structured_outputs.regex: "),
        (GrammarSpec("lark", "start: undefined_rule\n", "structured_outputs.grammar"), "structured_outputs.grammar: "),
        (json_schema_spec({"type": "nonsense"}, "response_format.json_schema.schema"), "response_format.json_schema"),
    ],
)
def test_a_bad_grammar_is_an_input_error_naming_the_field(tokenizer, spec, words):
    with pytest.raises(InputError, match=words):
        GrammarBook(tokenizer, StructuredConfig()).compile(spec)


def test_size_cap_and_the_kept_grammars(tokenizer):
    book = GrammarBook(tokenizer, StructuredConfig(max_schema_bytes=64, cached_grammars=2))
    with pytest.raises(InputError, match=r"response_format: \d+ bytes is more than structured.max_schema_bytes \(64\)"):
        book.compile(json_schema_spec({"type": "object", "description": "x" * 80}, "response_format"))
    specs = [GrammarSpec("regex", f"a{{{i}}}") for i in range(1, 4)]
    for spec in specs:
        book.compile(spec)
    assert list(book._templates) == specs[1:]  # the least recently used went first
    book.compile(specs[1])
    book.compile(specs[0])
    assert list(book._templates) == [specs[1], specs[0]]
    # a spec from another field is the same grammar: kept once
    assert GrammarSpec("regex", "a{2}", "x") == GrammarSpec("regex", "a{2}", "y")


def test_draft_guide_masks_each_draft_pass(tokenizer):
    """DraftGuide (grammar/constrain.py) against the matcher itself: row g's argmax is a token
    the grammar allows after the draft's first g tokens, whatever the raw logits prefer; an
    unconstrained sequence's row is untouched; past the grammar's end the rows are left alone."""
    import torch

    from ridgefill_runtime.grammar.constrain import DraftGuide

    book = GrammarBook(tokenizer, StructuredConfig())
    spec = GrammarSpec("choice", json.dumps(["yes please", "no thanks"]), "rf")
    guide = DraftGuide({7: book.matcher(spec)}, book.vocab_size)
    rows = tokenizer.vocab_size + 3  # a padded model has more logit rows than tokens
    favourite = tokenizer.encode("maybe", add_special_tokens=False)[0]
    draft = []
    for _ in range(12):
        logits = torch.zeros(2, rows)
        logits[:, favourite] = 10.0  # both rows prefer a token the grammar never allows
        guide.mask([7, 8], logits)
        assert logits[1].argmax().item() == favourite  # seq 8 is not constrained
        token = logits[0].argmax().item()
        probe = book.matcher(spec)
        eos = set(tokenizer.eos_token_ids)
        if not _consumed_all(probe, [t for t in draft if t not in eos]):
            assert probe.consume_tokens(draft + [token])  # allowed after the draft so far
        elif not eos & set(draft):
            assert token in eos  # complete: the end of text is all it allows
        else:  # past the end: the row is left to the model (the verification decides)
            assert token == favourite
        guide.take([7, 8], [token, favourite])
        draft.append(token)
    end = next(i for i, t in enumerate(draft) if t in set(tokenizer.eos_token_ids))
    assert tokenizer.decode(draft[:end]) in ("yes please", "no thanks") and draft[end + 1 :] == [favourite] * (11 - end)


def _consumed_all(matcher, tokens) -> bool:
    """Whether the grammar is complete after `tokens`."""
    m = matcher.deep_copy()
    m.consume_tokens(tokens)
    return m.is_stopped()
