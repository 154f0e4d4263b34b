"""A grammar engine's token bitmask as a boolean mask over the model's rows.

The bitmask is llguidance's (and xgrammar's) layout: int32 words, bit j of word w allowing
token 32 w + j. The model may have more rows than the tokenizer has tokens (a padded
vocabulary): those rows are never allowed.
"""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def mask_words(vocab: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab: int, rows: int) -> torch.Tensor:
    """bitmask [n, mask_words(vocab)] int32 -> allowed [n, rows] bool (rows >= vocab)."""
    n, words = bitmask.shape
    # NOTE: >> on int32 is arithmetic; & 1 keeps just the bit, so bit 31 (the sign) reads right
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1  # [n, words, 32]
    allowed = bits.reshape(n, words * 32)[:, :vocab].bool()  # [n, vocab]
    if rows > vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(n, rows - vocab)], dim=1)  # [n, rows]
    return allowed


def unpack_bitmask_reference(bitmask: torch.Tensor, vocab: int, rows: int) -> torch.Tensor:
    """unpack_bitmask, one token at a time: the definition the tests compare against."""
    out = torch.zeros(bitmask.shape[0], rows, dtype=torch.bool)
    for i, row in enumerate(bitmask.tolist()):
        for token in range(vocab):
            word = row[token // 32] & 0xFFFFFFFF  # the word's 32 bits, unsigned
            out[i, token] = bool((word >> (token % 32)) & 1)
    return out


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """logits [R, V]: the rows at `rows` [n] lose every token `allowed` [n, V] does not allow."""
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
