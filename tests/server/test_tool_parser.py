"""The Hermes tool-call parser (server/tool_parser.py) against a direct reading of the format:
whole texts give the content and calls written out by hand, and feeding the same text cut at
every position (as a stream arrives) gives the same content and calls. Nothing is lost: with no
call parsed, the content is the text itself."""

from __future__ import annotations

import json

import pytest

from ridgefill_server.tool_parser import HermesParser

NAMES = frozenset({"get_weather", "now"})
CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'

# text -> (content, [(name, arguments as objects)])
CASES = {
    CALL_A: ("", [("get_weather", {"city": "Paris"})]),
    "\n" + CALL_A + "\n" + CALL_B + "\n": ("", [("get_weather", {"city": "Paris"}), ("now", {})]),
    "Let me check.\n" + CALL_A: ("Let me check.", [("get_weather", {"city": "Paris"})]),
    "no calls here, < and <tool and </tool_call> too  ": ("no calls here, < and <tool and </tool_call> too  ", []),
    # bad JSON, an unknown function and an unclosed block stay content, as written
    "a\n<tool_call>\n{not json}\n</tool_call>": ("a\n<tool_call>\n{not json}\n</tool_call>", []),
    '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>': (
        '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
        [],
    ),
    CALL_A + '\n<tool_call>\n{"name": "now"': ('\n<tool_call>\n{"name": "now"', [("get_weather", {"city": "Paris"})]),
    CALL_A + " Done.": (" Done.", [("get_weather", {"city": "Paris"})]),
    '<tool_call>{"name": "now", "arguments": "{\\"x\\": 1}"}</tool_call>': ("", [("now", {"x": 1})]),
}


def parse(chunks: list[str]) -> tuple[str, list[tuple[str, dict]], int]:
    parser = HermesParser(NAMES)
    pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
    content = "".join(p.content for p in pieces)
    calls = [(p.call.name, json.loads(p.call.arguments)) for p in pieces if p.call is not None]
    return content, calls, parser.calls


@pytest.mark.parametrize("text", list(CASES))
def test_whole_text(text):
    content, calls, count = parse([text])
    assert (content, calls) == CASES[text]
    assert count == len(calls)


@pytest.mark.parametrize("text", list(CASES))
def test_every_split_and_every_token_size_agree_with_whole(text):
    whole = parse([text])
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]])[:2] == whole[:2], cut
    for size in (1, 2, 3, 7):
        assert parse([text[i : i + size] for i in range(0, len(text), size)])[:2] == whole[:2], size


def test_content_before_a_tag_goes_out_before_the_tag_arrives():
    parser = HermesParser(NAMES)
    assert [p.content for p in parser.feed("Sure, ")] == ["Sure,"]
    assert parser.feed("<tool") == []  # may be a tag: held
    assert [p.content for p in parser.feed("s> ok")] == [" <tools> ok"]


def test_each_call_has_its_own_id():
    parser = HermesParser(NAMES)
    pieces = parser.feed(CALL_A + "\n" + CALL_A) + parser.finish()
    ids = [p.call.id for p in pieces if p.call is not None]
    assert len(ids) == 2 and ids[0] != ids[1] and all(i.startswith("call_") for i in ids)
