"""Banded sliding-window attention against a float64 loop over rows (the definition), and the
dispatch in layers/attention.py that sends consecutive rows to it."""

import pytest
import torch

from ridgefill_runtime.layers import attention, window_attention
from ridgefill_runtime.layers.window_attention import banded_window_attention, worth_banding


def window_loop(q, k, v, scale, window):
    """float64, one row at a time: row r (position Lk - Lq + r) softmaxes over keys in (p - window, p]."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, heads, dim = q.shape
    group = heads // k.shape[1]
    out = torch.empty(q_len, heads, dim, dtype=torch.float64)
    for r in range(q_len):
        p = k.shape[0] - q_len + r
        lo = max(p - window + 1, 0)
        for h in range(heads):
            kk, vv = k[lo : p + 1, h // group], v[lo : p + 1, h // group]  # [n, D]
            w = torch.softmax(kk @ q[r, h] * scale, dim=0)
            out[r, h] = w @ vv
    return out.reshape(q_len, heads * dim)


@pytest.mark.parametrize(
    "q_len, k_len, window, block",
    [
        (64, 64, 8, 16),  # fresh prefill, bands whole
        (61, 61, 8, 16),  # last band padded
        (37, 100, 8, 16),  # a later chunk: queries are the last 37 keys
        (40, 40, 50, 16),  # window longer than the prompt: plain causal
        (33, 90, 1, 8),  # a row sees only itself
        (1, 50, 8, 16),  # one row
    ],
)
def test_banded_equals_the_row_loop(q_len, k_len, window, block):
    torch.manual_seed(q_len * 1000 + k_len)
    q, k, v = torch.randn(q_len, 4, 16), torch.randn(k_len, 2, 16), torch.randn(k_len, 2, 16)
    got = banded_window_attention(q, k, v, 0.25, window, block=block)
    assert got.shape == (q_len, 64)
    torch.testing.assert_close(got.double(), window_loop(q, k, v, 0.25, window), atol=2e-6, rtol=1e-5)


def test_more_bands_than_one_group(monkeypatch):
    monkeypatch.setattr(window_attention, "BAND_GROUP", 2)
    q, k, v = torch.randn(70, 2, 8), torch.randn(90, 1, 8), torch.randn(90, 1, 8)
    got = banded_window_attention(q, k, v, 0.3, 12, block=8)  # 9 bands in groups of 2
    torch.testing.assert_close(got.double(), window_loop(q, k, v, 0.3, 12), atol=2e-6, rtol=1e-5)


def test_more_queries_than_keys_is_refused():
    with pytest.raises(ValueError, match="query rows over"):
        banded_window_attention(torch.randn(5, 1, 4), torch.randn(4, 1, 4), torch.randn(4, 1, 4), 1.0, 2)


def _spy(monkeypatch):
    calls = []
    real = attention.banded_window_attention

    def spy(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(attention, "banded_window_attention", spy)
    return calls


def test_attend_sends_long_windowed_prompts_to_bands(monkeypatch):
    calls = _spy(monkeypatch)
    window = 8
    k_len = 2 * (window_attention.BAND_BLOCK + window) + 5
    assert worth_banding(k_len, k_len, window)
    q, k, v = torch.randn(k_len, 2, 8), torch.randn(k_len, 1, 8), torch.randn(k_len, 1, 8)
    got = attention.attend(q, k, v, 0.3, window=window)
    assert calls == [k_len]
    torch.testing.assert_close(got.double(), window_loop(q, k, v, 0.3, window), atol=2e-6, rtol=1e-5)


def test_attend_at_bands_only_consecutive_rows_ending_at_the_last_key(monkeypatch):
    calls = _spy(monkeypatch)
    window, k_len = 8, 2 * (window_attention.BAND_BLOCK + 8) + 40
    k, v = torch.randn(k_len, 1, 8), torch.randn(k_len, 1, 8)
    k_pos = torch.arange(100, 100 + k_len)  # a later chunk's keys, gathered from position 100 on
    q = torch.randn(30, 2, 8)
    tail = k_pos[-30:]
    got = attention.attend_at(q, tail, k, v, 0.3, k_pos=k_pos, window=window)
    assert calls == [30]
    torch.testing.assert_close(got.double(), window_loop(q, k, v, 0.3, window), atol=2e-6, rtol=1e-5)
    scattered = k_pos[[-40, -30, -20, -10, -1]]  # chosen rows: the mask path
    attention.attend_at(q[:5], scattered, k, v, 0.3, k_pos=k_pos, window=window)
    not_last = k_pos[-31:-1]  # consecutive, but the keys reach past them: the mask path
    attention.attend_at(q, not_last, k, v, 0.3, k_pos=k_pos, window=window)
    assert calls == [30]
