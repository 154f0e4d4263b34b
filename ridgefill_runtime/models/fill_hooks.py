"""What RidgeFill's two-sweep prefill (fill/two_sweep.py) asks of a model family: a few pieces of
its forward, run on their own. The driver owns the step's order (lower layers, the split, filled
rows' K/V, the late layers, corrections); a family implements these hooks, not a driver.

The family differences are data and one override: `keeps_kv` says which layers attend (a hybrid's
Gated DeltaNet layers carry a recurrent state instead), `rescale_from_layer_kv` where the value /
key rescale takes the measuring rows' exact K/V, and `late_layer` how a layer runs the late part
(a hybrid's carries its recurrent state over filled rows from x̂)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..config import ModelConfig
from ..layers.attention import AttentionBatch

OnKV = Callable[[int, torch.Tensor, torch.Tensor], None]  # (layer, k [N, Hkv, D], v [N, Hkv, D])
OnQ = Callable[[int, torch.Tensor], None]  # (layer, q [N, H, D])


def unsharded(x: torch.Tensor) -> torch.Tensor:
    """sum_shards of a model on one rank: its partial sums are whole already."""
    return x


@dataclass(frozen=True)
class LateRows:
    """What a late layer of a two-sweep step reads besides its input h [M, d] (the late part).

    Rows that are filled prefix rows (hybrids only) carry the recurrent layers' states from
    x̂_l and nothing else; the other rows, `exact`, attend and run the MLP."""

    batch: AttentionBatch  # layout of all M rows (a recurrent layer walks every one)
    caches: object  # the runner's ModelCaches
    rope: tuple[torch.Tensor, ...]  # the exact rows' rotary angles
    exact_batch: AttentionBatch  # the exact rows' layout (batch when every row is exact)
    exact: torch.Tensor | None = None  # [E] indices into the late part; None: every row is exact
    filled: torch.Tensor | None = None  # [M] bool, the complement of exact; None: no filled row
    predicted: Callable[[int], torch.Tensor] | None = None  # layer -> x̂ [M - E, d] of the filled rows
    # [M] bool: the rows whose gates count as filled in the terminal correction's sums (all False
    # on a step without filled rows); None: the correction is off
    share_filled: torch.Tensor | None = None
    on_kv: OnKV | None = None  # sees an attention layer's fresh K/V of every exact row
    on_q: OnQ | None = None  # sees an attention layer's queries, indexed by late-part row

    def __post_init__(self):
        if (self.exact is None) != (self.filled is None) or (self.filled is None) != (self.predicted is None):
            raise ValueError("filled rows come with the exact rows' indices and their x̂")


@runtime_checkable
class FillHooks(Protocol):
    """The model pieces the two-sweep driver calls. Tensors: h [N, d] hidden rows; rope: a row's
    rotary angles as rope(positions) returns them (a family may keep more than one pair)."""

    config: ModelConfig
    scale: float  # the attention's softmax scale (the selectors' attention mass is measured with it)
    rescale_from_layer_kv: bool  # the rescale's exact K/V: the layer's own (on_kv), else kv_only of its input

    def sum_shards(self, x: torch.Tensor) -> torch.Tensor:
        """A partial result over this rank's heads summed over the tensor-parallel group, in place
        (identity on one rank)."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> h [N, d]."""

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rotary angles of rows at `positions` [N]."""

    def keeps_kv(self, layer: int) -> bool:
        """The layer attends over paged K/V (False: it carries a recurrent state)."""

    def window(self, layer: int) -> int:
        """The layer's sliding window (0: it sees every earlier key)."""

    def layer(self, i: int, h: torch.Tensor, rope, batch: AttentionBatch, caches, rows=None, on_q=None):
        """The exact layer i over every row of `batch` (the lower sweep)."""

    def kv_only(self, layer: int, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """What a filled row writes at an attention layer: layer input [F, d] -> k, v [F, Hkv, D]."""

    def late_layer(self, i: int, h: torch.Tensor, late: LateRows, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i over the late part: h [M, d] -> [M, d] ([R, d] for `rows`, the top layer's
        logit rows). May update h in place."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Top hidden rows [R, d] -> float32 logits [R, V]."""
