"""The fill's prefill ceiling counted in multiply-accumulates, attention included.

Seed 000 §2.5's ceiling is 1/r with r = S/L + (1 - S/L)·T/N: it counts layers, as if every row
of every layer cost the same. Attention breaks that. A row's attention grows with its position,
and the fill's tail rows, the last T, are the costliest rows of every late layer. A filled row
still pays for its map and its K/V projections. So 1/r overstates what is left to win, more so
as the prompt grows.

Per late layer, this counts:
- a filled row: the map (hidden × hidden) and the k, v projections; no attention;
- a tail row: as in exact prefill, the layer's linear MACs plus attention over every key it
  reads (its window on a sliding-window layer).

Lower layers and exact prefill count every row's linear and attention MACs. Rows the selectors
choose inside the filled region (`chosen`, their positions) run like tail rows, attending over
the keys up to their own position.

The final layer, in both arms, attends and runs o and the MLP for the one row whose logits are
wanted (models' `rows=logit_rows`); every other row there only writes its K/V, through the fused
q/k/v projection (a filled row: its map and k, v). Counting the whole final layer, as this did
before, overstated exact prefill's work by about a layer and the ceiling with it (Gemma 3 270M at
16K: 1.72 counted, 1.56 once the final layer is counted as it runs). Left out on both sides:
norms, RoPE, the softmax, the embedding and the LM head (one row either way).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cache.spec import AttentionCache


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    q_width: int  # num_heads * head_dim
    kv_width: int  # num_kv_heads * head_dim
    intermediate: int  # gated MLP: gate, up and down, each hidden × intermediate
    window: int = 0  # 0: global attention

    def __post_init__(self) -> None:
        if min(self.hidden, self.q_width, self.kv_width, self.intermediate) <= 0 or self.window < 0:
            raise ValueError(f"layer shape needs positive widths and window >= 0, got {self}")

    def linear_macs(self) -> int:
        """Per row: q and o (hidden × q_width each), k and v, and the gated MLP."""
        return self.hidden * (2 * self.q_width + 2 * self.kv_width) + 3 * self.hidden * self.intermediate

    def qkv_macs(self) -> int:
        """Per row: the fused q, k, v projection, all a non-logit row runs in the final layer."""
        return self.hidden * (self.q_width + 2 * self.kv_width)

    def final_layer_macs(self, rows: int, n: int) -> int:
        """The final layer of an n-row prompt: `rows` of them project q, k, v and the last one
        (whose logits are wanted) also attends and runs o and the MLP."""
        return rows * self.qkv_macs() + self.linear_macs() - self.qkv_macs() + self.attention_macs(n - 1, n)

    def filled_row_macs(self) -> int:
        """Per filled row of a late layer: the ridge map and the k, v projections."""
        return self.hidden * self.hidden + 2 * self.hidden * self.kv_width

    def attention_macs(self, first: int, end: int) -> int:
        """Rows first..end-1 of a causal prompt: q·k and p·v over the keys each row reads."""
        return 2 * self.q_width * keys_read(first, end, self.window)


def keys_read(first: int, end: int, window: int) -> int:
    """Sum over rows i in [first, end) of the keys row i reads: i + 1, or at most `window`."""

    def up_to(n: int) -> int:  # rows 0..n-1
        if window == 0 or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window

    return up_to(end) - up_to(first)


def full_macs(layers: tuple[LayerShape, ...], n: int) -> int:
    """Every row of every layer in `layers` (none of them the final one)."""
    return sum(layer.linear_macs() * n + layer.attention_macs(0, n) for layer in layers)


def exact_macs(layers: tuple[LayerShape, ...], n: int) -> int:
    return full_macs(layers[:-1], n) + layers[-1].final_layer_macs(n, n)


def fill_macs(layers: tuple[LayerShape, ...], n: int, split: int, tail: int, chosen: tuple[int, ...] = ()) -> int:
    t = min(tail, n)
    chosen = tuple(p for p in set(chosen) if 0 <= p < n - t)  # NOTE: a chosen row inside the tail is a tail row
    filled = (n - t - len(chosen)) * sum(layer.filled_row_macs() for layer in layers[split:])
    late = sum(
        (t + len(chosen)) * layer.linear_macs()
        + layer.attention_macs(n - t, n)
        + sum(layer.attention_macs(p, p + 1) for p in chosen)
        for layer in layers[split:-1]
    )
    final = layers[-1].final_layer_macs(t + len(chosen), n)
    return full_macs(layers[:split], n) + filled + late + final


def ceiling(layers: tuple[LayerShape, ...], n: int, split: int, tail: int, chosen: tuple[int, ...] = ()) -> float:
    """Exact prefill's MACs over the fill's: the speedup if time followed MACs."""
    if not 0 < split < len(layers):
        raise ValueError(f"split must be inside 1..{len(layers) - 1}, got {split}")
    return exact_macs(layers, n) / fill_macs(layers, n, split, tail, chosen)


def layer_shapes(config, spec_layers) -> tuple[LayerShape, ...]:
    """One shape per layer from a ModelConfig and its cache spec's layers. Only attention
    layers are counted; a recurrent layer has no K/V to count this way."""
    shapes = []
    for i, cache in enumerate(spec_layers):
        if not isinstance(cache, AttentionCache):
            raise ValueError(f"layer {i} keeps {type(cache).__name__}: the MAC ceiling counts attention layers only")
        shapes.append(
            LayerShape(
                hidden=config.hidden_size,
                q_width=config.num_heads * config.head_dim,
                kv_width=cache.num_kv_heads * cache.head_dim,
                intermediate=config.intermediate_size,
                window=cache.window,
            )
        )
    return tuple(shapes)
