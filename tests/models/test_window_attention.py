"""Banded sliding-window attention against a float64 loop over rows (the definition), and the
dispatch in layers/attention.py that sends rows in ascending position to it."""

import pytest
import torch

from ridgefill_runtime.layers import attention, window_attention
from ridgefill_runtime.layers.window_attention import banded_window_attention, worth_banding


def window_loop(q, q_pos, k, v, k_pos, scale, window):
    """float64, one row at a time: the row at position p softmaxes over keys at (p - window, p]
    (window 0: at most p)."""
    q, k, v = q.double(), k.double(), v.double()
    rows, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for r, p in enumerate(q_pos.tolist()):
        seen = (k_pos <= p) & (k_pos > p - window) if window else k_pos <= p
        for h in range(heads):
            kk, vv = k[seen, h // group], v[seen, h // group]  # [n, D]
            out[r, h] = torch.softmax(kk @ q[r, h] * scale, dim=0) @ vv
    return out.reshape(rows, heads * dim)


def last_rows(q_len, k_len):
    keys = torch.arange(k_len)
    return keys[k_len - q_len :], keys


@pytest.mark.parametrize(
    "q_len, k_len, window, block",
    [
        (64, 64, 8, 16),  # fresh prefill, bands whole
        (61, 61, 8, 16),  # last band short
        (37, 100, 8, 16),  # a later chunk: queries are the last 37 keys
        (40, 40, 50, 16),  # window longer than the prompt: plain causal
        (33, 90, 1, 8),  # a row sees only itself
        (1, 50, 8, 16),  # one row
        (37, 100, 0, 16),  # a global layer
    ],
)
def test_banded_equals_the_row_loop(q_len, k_len, window, block):
    torch.manual_seed(q_len * 1000 + k_len)
    q, k, v = torch.randn(q_len, 4, 16), torch.randn(k_len, 2, 16), torch.randn(k_len, 2, 16)
    q_pos, k_pos = last_rows(q_len, k_len)
    got = banded_window_attention(q, q_pos, k, v, k_pos, 0.25, window, block=block)
    assert got.shape == (q_len, 64)
    want = window_loop(q, q_pos, k, v, k_pos, 0.25, window)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_scattered_rows_over_gathered_keys():
    """The fill's exact rows: spread positions, then a tail; keys gathered from position 300 on
    with holes (positions no row's window reaches are not gathered)."""
    torch.manual_seed(3)
    k_pos = torch.cat([torch.arange(300, 420), torch.arange(500, 900)])  # [520]
    q_pos = torch.cat([torch.tensor([330, 331, 410, 560, 561, 700]), torch.arange(850, 900)])
    q, k, v = torch.randn(len(q_pos), 4, 8), torch.randn(len(k_pos), 1, 8), torch.randn(len(k_pos), 1, 8)
    for window in (24, 0):
        got = banded_window_attention(q, q_pos, k, v, k_pos, 0.3, window, block=8)
        want = window_loop(q, q_pos, k, v, k_pos, 0.3, window)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_a_windowed_band_spans_at_most_block_positions_and_a_global_one_block_rows():
    """Sparse rows (the fill's chosen exact rows, ~10 positions apart) on a windowed layer: each band
    holds the rows of one run of `block` positions, so it scores at most block + window - 1 keys a
    row; contiguous rows band as block rows; a global layer bands by rows."""
    sparse = torch.arange(3, 1000, 10)  # [100]
    starts = window_attention.band_starts(sparse, 64, 16)
    spans = [int(sparse[b - 1] - sparse[a]) for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]
    assert int(starts[0]) == 0 and int(starts[-1]) == 100 and max(spans) < 64
    assert (starts.diff() > 0).all()
    contiguous = torch.arange(128, 384)
    assert window_attention.band_starts(contiguous, 64, 16).tolist() == [0, 64, 128, 192, 256]
    assert window_attention.band_starts(sparse, 64, 0).tolist() == [0, 64, 100]


def test_sparse_rows_on_a_windowed_layer_equal_the_row_loop():
    torch.manual_seed(5)
    k_pos = torch.arange(0, 700)
    q_pos = torch.cat([torch.arange(5, 600, 11), torch.arange(640, 700)])  # spread, then a tail
    q, k, v = torch.randn(len(q_pos), 4, 8), torch.randn(700, 2, 8), torch.randn(700, 2, 8)
    got = banded_window_attention(q, q_pos, k, v, k_pos, 0.3, 24, block=32)
    torch.testing.assert_close(got.double(), window_loop(q, q_pos, k, v, k_pos, 0.3, 24), atol=2e-6, rtol=1e-5)


def _spy(monkeypatch):
    calls = []
    real = attention.banded_window_attention

    def spy(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(attention, "banded_window_attention", spy)
    return calls


@pytest.mark.parametrize("past_window", [1, 2 * window_attention.BAND_BLOCK + 13])
def test_attend_sends_windowed_prompts_longer_than_the_window_to_bands(monkeypatch, past_window):
    calls = _spy(monkeypatch)
    window = 8
    k_len = window + past_window
    assert worth_banding(k_len, k_len, window)
    q, k, v = torch.randn(k_len, 2, 8), torch.randn(k_len, 1, 8), torch.randn(k_len, 1, 8)
    got = attention.attend(q, k, v, 0.3, window=window)
    assert calls == [k_len]
    want = window_loop(q, *last_rows(k_len, k_len)[:1], k, v, torch.arange(k_len), 0.3, window)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


def test_attend_at_bands_rows_in_ascending_order_only(monkeypatch):
    calls = _spy(monkeypatch)
    window, k_len = 8, 2 * (window_attention.BAND_BLOCK + 8) + 40
    k, v = torch.randn(k_len, 1, 8), torch.randn(k_len, 1, 8)
    k_pos = torch.arange(100, 100 + k_len)  # a later chunk's keys, gathered from position 100 on
    q = torch.randn(30, 2, 8)
    for q_pos in (k_pos[-30:], k_pos[-31:-1], k_pos[torch.linspace(0, k_len - 1, 30).long()]):
        got = attention.attend_at(q, q_pos, k, v, 0.3, k_pos=k_pos, window=window)
        want = window_loop(q, q_pos, k, v, k_pos, 0.3, window)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert calls == [30, 30, 30]
    shuffled = k_pos[[-1, -5, -3]]  # not ascending: the mask path
    got = attention.attend_at(q[:3], shuffled, k, v, 0.3, k_pos=k_pos, window=window)
    assert calls == [30, 30, 30]
    torch.testing.assert_close(
        got.double(), window_loop(q[:3], shuffled, k, v, k_pos, 0.3, window), atol=2e-6, rtol=1e-5
    )
