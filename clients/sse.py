"""Server-sent-event lines as the SSE spec splits them: at CR LF, LF or CR, nowhere else.

httpx's `iter_lines` / `aiter_lines` split like `str.splitlines()`, which also breaks at
U+2028, U+2029, U+0085 and a few control characters. Servers that write those characters raw
inside a JSON string (llama-server does; so did ours until it escaped them) then have one
event read as two broken lines. Splitting the bytes first is safe: CR and LF never occur
inside a UTF-8 multi-byte sequence.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable, Iterator

_LINE_END = re.compile(rb"\r\n|\r|\n")


class SSELineSplitter:
    """Feed bytes, get whole lines (str, without their ending); `flush` returns the rest."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._after_cr = False  # the last chunk ended in CR: a leading LF belongs to it

    def feed(self, chunk: bytes) -> list[str]:
        if self._after_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._after_cr = chunk[-1:] == b"\r"
        if not chunk:
            return []
        self._buf += chunk
        *whole, rest = _LINE_END.split(self._buf)
        self._buf = bytearray(rest)
        return [line.decode("utf-8", errors="replace") for line in whole]

    def flush(self) -> list[str]:
        rest, self._buf = bytes(self._buf), bytearray()
        return [rest.decode("utf-8", errors="replace")] if rest else []


def split_lines(chunks: Iterable[bytes]) -> Iterator[str]:
    splitter = SSELineSplitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.flush()


async def asplit_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an httpx response body: `asplit_lines(response.aiter_bytes())`."""
    splitter = SSELineSplitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.flush():
        yield line
