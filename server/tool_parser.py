"""Tool calls read out of a chat choice's text, as it streams: the Hermes format that Qwen2.5's
chat template teaches (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`).

One parser serves the streamed and the plain answer (the plain one feeds the whole text at
once), so the two cannot disagree. Text outside the call blocks is content. Text that may be the
start of an opening tag is held until it is known; whitespace is held too, and dropped when a
call follows it or the choice ends after a call (the template writes a newline between calls).
A block that does not parse as a call to a known function (bad JSON, an unknown name, no
closing tag by the end) goes out as content, as the model wrote it: nothing is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: `arguments` as the JSON text OpenAI's clients expect."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Piece:
    """What the parser lets out: content text, or one whole call."""

    content: str = ""
    call: ParsedCall | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class HermesParser:
    def __init__(self, names: frozenset[str], open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        """`names`: the request's functions; a call to any other name stays content."""
        self.names, self.open_tag, self.close_tag = names, open_tag, close_tag
        self._pending = ""  # text not yet let out: a possible tag start, whitespace, or an open block
        self._in_block = False
        self._gap = ""  # the whitespace before the open block: dropped if it is a call, kept if not
        self.calls = 0  # calls let out so far

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        out: list[Piece] = []
        while True:
            if self._in_block:
                end = self._pending.find(self.close_tag)
                if end < 0:
                    return out
                block = self._pending[: end + len(self.close_tag)]
                self._pending = self._pending[len(block) :]
                self._in_block = False
                out.append(self._block(block))
                continue
            start = self._pending.find(self.open_tag)
            if start >= 0:
                before = self._pending[:start]
                text = before.rstrip()  # NOTE: a stream would have held the whitespace
                self._gap = before[len(text) :]
                if text:
                    out.append(Piece(content=text))
                self._pending = self._pending[start:]
                self._in_block = True
                continue
            keep = _held_tail(self._pending, self.open_tag)
            if self._pending[:keep]:
                out.append(Piece(content=self._pending[:keep]))
            self._pending = self._pending[keep:]
            return out

    def finish(self) -> list[Piece]:
        """The choice has ended: an unclosed block, a partial tag or held whitespace is content
        (whitespace after a call is dropped)."""
        rest = self._gap + self._pending if self._in_block else self._pending
        self._pending, self._in_block = "", False
        if not rest or (not rest.strip() and self.calls):
            return []
        return [Piece(content=rest)]

    def _block(self, block: str) -> Piece:
        call = self._call_of(block[len(self.open_tag) : -len(self.close_tag)])
        if call is None:
            return Piece(content=self._gap + block)
        self.calls += 1
        return Piece(call=call)

    def _call_of(self, body: str) -> ParsedCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            text = arguments
        else:
            text = json.dumps(arguments, ensure_ascii=False)
        return ParsedCall(new_call_id(), value["name"], text)


def _held_tail(text: str, tag: str) -> int:
    """Where the text that may still turn into (whitespace before) `tag` begins: the longest
    suffix that is a proper prefix of the tag, and the whitespace before it."""
    cut = len(text)
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            cut = len(text) - k
            break
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return cut
