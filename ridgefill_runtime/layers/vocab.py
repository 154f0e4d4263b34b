"""The embedding and LM head of a model that may hold only some rows of its vocabulary: a
tensor-parallel rank's part (ModelConfig.vocab_rows; parallel/shard.py cuts the tables by token).

A rank looks up the ids in its rows and zeroes the others; the all-reduce (the model's
sum_shards) then adds each row's one lookup. Its LM head gives the logits of its tokens, and the
model's gather_vocab joins every rank's columns, so every rank samples from the whole [R, V] as
one rank would. On one rank both hooks are the identity and this is a plain lookup and GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.packed_linear import linear, weight_rows

Shards = Callable[[torch.Tensor], torch.Tensor]


def embed_tokens(
    table, ids: torch.Tensor, dtype: torch.dtype, rows: tuple[int, int] | None, sum_shards: Shards
) -> torch.Tensor:
    """ids [N] -> hidden [N, d]; `table` holds vocabulary rows rows[0]..rows[1] (None: every row)."""
    if rows is None:
        return weight_rows(table, ids, dtype)
    lo, hi = rows
    own = (ids >= lo) & (ids < hi)  # [N]
    h = weight_rows(table, (ids - lo).clamp(0, hi - lo - 1), dtype) * own[:, None].to(dtype)  # [N, d]
    return sum_shards(h)


def vocab_logits(x: torch.Tensor, head, gather_vocab: Shards) -> torch.Tensor:
    """Normed final rows [R, d] -> logits [R, V] over the whole vocabulary, in the head's dtype
    (float32 and float64 stay)."""
    return gather_vocab(linear(x, head))  # [R, V_rank] -> [R, V]
