"""How many input bytes one token can stand for, read once from a tokenizer's vocabulary.

A prompt of B bytes then holds at least ceil(B / longest) tokens, so a server can refuse a prompt
that cannot fit the context before tokenizing it (3 MB of text takes SmolLM2's tokenizer 18 s of
CPU; the refusal takes microseconds).

The bound holds only where every token stands for a bounded run of the input: a BPE model (its
unknown token stands for one character, or it has a token for every byte) whose normalizer and pre-tokenizer never drop
text. Anything else (WordPiece and Unigram models, a pre-tokenizer that removes whitespace, a
normalizer that strips) gets None: no bound, and such a prompt is tokenized whole as before.
"""

from __future__ import annotations

import json

import tokenizers

MAX_UTF8_CHAR = 4  # an unknown character becomes one token: at most this many bytes
# NFC composes at most a few characters into one: Hangul L+V+T jamo (9 bytes) into a 3-byte
# syllable, a Greek vowel with three marks (8 bytes) into 3. So a normalized byte stands for at
# most this many input bytes.
NFC_SHRINK = 4
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "Punctuation"}


def longest_piece_bytes(backend: tokenizers.Tokenizer) -> int | None:
    """The most input bytes (UTF-8) one token of `backend` can stand for; None when no bound holds."""
    document = json.loads(backend.to_str())
    model = document["model"]
    shrink = _normalizer_shrink(document.get("normalizer"))
    if model.get("type") != "BPE" or model.get("fuse_unk") or shrink is None:
        return None
    pre = document.get("pre_tokenizer")
    byte_level = _has_byte_level(pre)
    # NOTE: a BPE without byte tokens or an unknown token drops characters it has no token for
    covers_every_character = byte_level or model.get("byte_fallback") or model.get("unk_token") is not None
    if not _keeps_text(pre) or not covers_every_character:
        return None
    # NOTE: a byte-level token spells each input byte as one character (2 bytes in UTF-8 when not
    # ASCII); counting characters keeps the bound tight. Other vocabularies are counted in UTF-8
    # bytes, which a SentencePiece "▁" (3 bytes for a 1-byte space) only overstates.
    pieces = (len(token) if byte_level else len(token.encode("utf-8")) for token in model["vocab"])
    longest = max(pieces, default=1)
    added = (len(t["content"].encode("utf-8")) for t in document.get("added_tokens") or [])
    return max(longest * shrink, MAX_UTF8_CHAR, max(added, default=0))


def fewest_tokens(text_bytes: int, longest_piece: int) -> int:
    """The fewest tokens a text of `text_bytes` bytes can become."""
    return -(-text_bytes // longest_piece)


def _normalizer_shrink(normalizer: dict | None) -> int | None:
    """How many input bytes one normalized byte can stand for; None when the normalizer may drop text."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factors = [_normalizer_shrink(n) for n in normalizer.get("normalizers", [])]
        if any(f is None for f in factors):
            return None
        product = 1
        for f in factors:
            product *= f  # type: ignore[operator]
        return product
    if kind == "Prepend":
        return 1  # only adds text
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        literal = pattern.get("String")
        # NOTE: a literal replaced by something at least as long shrinks nothing (" " -> "▁")
        return 1 if literal is not None and len(content.encode()) >= len(literal.encode()) else None
    if kind == "NFC":
        return NFC_SHRINK
    return None


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has_byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"
