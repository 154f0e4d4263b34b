"""SSE line splitting (clients/sse.py) against the spec's line endings, and the server's events
read by a client that splits like str.splitlines() (httpx's iter_lines)."""

from __future__ import annotations

import json
import random

from httpx._decoders import LineDecoder

from ridgefill_clients.sse import SSELineSplitter, split_lines
from ridgefill_server.protocol import CompletionChoice, CompletionChunk
from ridgefill_server.streaming import sse

# Every character str.splitlines() breaks at that the SSE spec does not (spec: CR LF, LF, CR).
NOT_SSE_LINE_ENDS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_lines_end_only_where_the_spec_says():
    raw = 'data: {"text": "a\u2028b\x85c\u2029"}\r\ndata: x\ry\n\ndata: [DONE]\n\n'.encode()
    assert list(split_lines([raw])) == [
        'data: {"text": "a\u2028b\x85c\u2029"}',
        "data: x",
        "y",
        "",
        "data: [DONE]",
        "",
    ]


def test_any_chunking_gives_the_same_lines():
    # CR LF split across chunks must stay one line end; a UTF-8 sequence split across chunks
    # must decode whole.
    text = "".join(random.Random(0).choice(["ab", "\r\n", "\r", "\n", "é", "\u2028", "猫", " "]) for _ in range(400))
    raw = text.encode()
    whole = list(split_lines([raw]))
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(raw)), rng.randint(1, 40)))
        chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
        assert list(split_lines(chunks)) == whole
    assert "".join(whole) == text.replace("\r", "").replace("\n", "")


def test_a_cr_then_lf_alone_in_the_next_chunk_is_one_line_end():
    s = SSELineSplitter()
    assert s.feed(b"data: a\r") == ["data: a"]
    assert s.feed(b"\n") == []
    assert s.feed(b"\ndata: b\n") == ["", "data: b"]


def test_server_events_survive_a_splitlines_client():
    text = "x" + "y".join(NOT_SSE_LINE_ENDS) + "z"
    chunk = CompletionChunk(
        id="cmpl-1", created=0, model="m", choices=[CompletionChoice(index=0, text=text)], usage=None
    )
    for event in (sse(chunk), sse({"error": {"message": text}})):
        decoder = LineDecoder()
        lines = decoder.decode(event) + decoder.flush()
        assert lines == [event[: -len("\n\n")], ""], lines  # one data line, then the blank line
        payload = json.loads(lines[0][len("data: ") :])
        got = payload["choices"][0]["text"] if "choices" in payload else payload["error"]["message"]
        assert got == text
