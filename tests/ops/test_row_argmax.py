"""row_argmax against torch's own first-maximum index (row_argmax_reference = max(-1).indices)."""

import pytest
import torch

from ridgefill_runtime.ops.row_argmax import row_argmax, row_argmax_reference


@pytest.mark.parametrize("cols", [262144, 262145, 151936, 3000, 2048, 1000])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_matches_torch_on_random_rows(rows, cols):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    assert torch.equal(row_argmax(x), row_argmax_reference(x))


def test_ties_take_the_first_maximum_across_and_inside_blocks():
    x = torch.zeros(4, 5000)
    x[0, [10, 4000]] = 3.0  # two blocks hold it: the first
    x[1, [2050, 2051, 4999]] = 3.0  # inside one block: the first column
    x[2, 4999] = 7.0  # only in the last, shorter block, at its last column
    x[3] = float("-inf")  # every column ties: column 0
    got = row_argmax(x, block=1024)
    assert got.tolist() == [10, 2050, 4999, 0]
    assert torch.equal(got, row_argmax_reference(x))


def test_a_row_with_nan_gets_torchs_answer():
    x = torch.randn(3, 4096)
    x[1, 3000] = float("nan")
    assert torch.equal(row_argmax(x, block=1024), row_argmax_reference(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    x = torch.randn(8, 9000, generator=torch.Generator().manual_seed(3)).to(dtype)  # many ties at bf16
    assert torch.equal(row_argmax(x, block=512), row_argmax_reference(x))


def test_a_strided_view_is_answered_too():
    x = torch.randn(6, 8192)[::2]  # rows strided, columns contiguous
    y = torch.randn(8192, 6).t()  # columns strided: falls back to torch
    assert torch.equal(row_argmax(x), row_argmax_reference(x))
    assert torch.equal(row_argmax(y), row_argmax_reference(y))
