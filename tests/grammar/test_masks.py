"""The grammar engine's bitmask as a boolean mask over the model's rows, against the
one-token-at-a-time definition; and masking a step's rows leaves every other row alone."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.grammar.masks import apply_masks, mask_words, unpack_bitmask, unpack_bitmask_reference


@pytest.mark.parametrize("vocab, rows", [(32, 32), (70, 70), (61, 64), (1000, 1040), (5, 40)])
def test_unpack_equals_the_definition(vocab, rows):
    g = torch.Generator().manual_seed(vocab)
    words = mask_words(vocab)
    bitmask = torch.randint(-(2**31), 2**31, (4, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # every bit, the sign bit included
    bitmask[1] = 0
    got = unpack_bitmask(bitmask, vocab, rows)
    assert got.shape == (4, rows) and got.dtype == torch.bool
    assert torch.equal(got, unpack_bitmask_reference(bitmask, vocab, rows))
    assert got[0, :vocab].all() and not got[0, vocab:].any()  # padded rows are never allowed
    assert not got[1].any()


def test_apply_masks_touches_only_the_picked_rows_and_disallowed_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g)
    before = logits.clone()
    allowed = torch.rand(2, 40, generator=g) < 0.3
    rows = torch.tensor([1, 4])
    apply_masks(logits, rows, allowed)
    for i in range(5):
        for t in range(40):
            if i in (1, 4) and not allowed[[1, 4].index(i), t]:
                assert logits[i, t] == float("-inf")
            else:
                assert logits[i, t] == before[i, t]
