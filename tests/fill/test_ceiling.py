"""fill/ceiling.py against a row-by-row count written out from its definition."""

from __future__ import annotations

import pytest

from ridgefill_runtime.cache.spec import AttentionCache, RecurrentCache
from ridgefill_runtime.config import ModelConfig
from ridgefill_runtime.fill.ceiling import LayerShape, ceiling, exact_macs, fill_macs, keys_read, layer_shapes


def naive_fill_and_exact(layers, n, split, tail, chosen=()):
    """Every row of every layer counted one at a time (the reference). In the final layer only the
    last row (the one whose logits are wanted) attends and runs o and the MLP; the others project
    q, k and v."""
    exact = fill = 0
    for index, layer in enumerate(layers):
        for i in range(n):
            keys = i + 1 if layer.window == 0 else min(i + 1, layer.window)
            qkv = layer.hidden * layer.q_width + 2 * layer.hidden * layer.kv_width  # q; k, v
            full = (
                qkv
                + layer.q_width * layer.hidden  # o
                + 3 * layer.hidden * layer.intermediate  # gate, up, down
                + 2 * layer.q_width * keys  # q·k and p·v
            )
            if index == len(layers) - 1 and i < n - 1:
                full = qkv
            exact += full
            filled = index >= split and i < n - tail and i not in chosen
            fill += layer.hidden * layer.hidden + 2 * layer.hidden * layer.kv_width if filled else full
    return fill, exact


@pytest.mark.parametrize("first, end, window", [(0, 1, 0), (0, 37, 0), (5, 37, 0), (0, 37, 8), (3, 9, 8), (20, 37, 8)])
def test_keys_read_matches_a_loop(first, end, window):
    assert keys_read(first, end, window) == sum(i + 1 if window == 0 else min(i + 1, window) for i in range(first, end))


@pytest.mark.parametrize("n, split, tail", [(64, 2, 16), (64, 1, 64), (64, 3, 100), (50, 2, 1)])
def test_macs_match_the_row_by_row_count(n, split, tail):
    layers = (
        LayerShape(hidden=24, q_width=32, kv_width=8, intermediate=40),
        LayerShape(hidden=24, q_width=32, kv_width=8, intermediate=40, window=8),
        LayerShape(hidden=24, q_width=32, kv_width=8, intermediate=40),
        LayerShape(hidden=24, q_width=32, kv_width=8, intermediate=40, window=16),
    )
    fill, exact = naive_fill_and_exact(layers, n, split, tail)
    assert exact_macs(layers, n) == exact
    assert fill_macs(layers, n, split, tail) == fill
    assert ceiling(layers, n, split, tail) == pytest.approx(exact / fill)
    chosen = tuple(p for p in (0, 5, 9, n - 1, n - tail - 1) if p >= 0)  # NOTE: some fall inside the tail
    fill, _ = naive_fill_and_exact(layers, n, split, tail, chosen)
    assert fill_macs(layers, n, split, tail, chosen) == fill


def test_a_tail_over_the_whole_prompt_saves_nothing_and_a_shorter_tail_saves_more():
    layers = (LayerShape(hidden=576, q_width=576, kv_width=192, intermediate=1536),) * 30
    assert ceiling(layers, 4096, 15, 4096) == pytest.approx(1.0)
    by_tail = [ceiling(layers, 4096, 15, t) for t in (2048, 1024, 512)]
    assert 1.0 < by_tail[0] < by_tail[1] < by_tail[2]


def test_layer_shapes_reads_config_and_windows_and_refuses_recurrent_layers():
    config = ModelConfig(
        architecture="llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=40,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    shapes = layer_shapes(config, (AttentionCache(2, 8), AttentionCache(2, 8, window=4)))
    assert shapes == (LayerShape(16, 32, 16, 40, 0), LayerShape(16, 32, 16, 40, 4))
    with pytest.raises(ValueError, match="layer 1 keeps RecurrentCache"):
        layer_shapes(config, (AttentionCache(2, 8), RecurrentCache(parts=(("state", (2, 8, 8)),))))
    with pytest.raises(ValueError, match="split must be inside"):
        ceiling(shapes, 16, 2, 4)
