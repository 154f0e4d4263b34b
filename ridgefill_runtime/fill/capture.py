"""Run a document exactly and hand each layer's input to a consumer as it is computed."""

from __future__ import annotations

from typing import Callable

import torch

from ..cache.kv_pool import KVPool
from ..layers.attention import AttentionBatch


@torch.inference_mode()
def run_layer_inputs(model, ids: list[int], consume: Callable[[int, torch.Tensor], None],
                     upto: int | None = None) -> None:
    """Exact prefill of one sequence; calls consume(layer, x_layer [n, d]) for each layer
    input 0..upto (default: every layer), in order. Uses a private scratch cache."""
    cfg = model.config
    n = len(ids)
    upto = cfg.num_layers - 1 if upto is None else upto
    kv = KVPool(upto + 1, n, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)
    positions = torch.arange(n, device=model.device)
    batch = AttentionBatch(query_starts=[0, n], context_lens=[n], write_slots=positions, read_slots=[None])
    h = model.embed(torch.tensor(ids, device=model.device))
    rope = model.rope(positions)
    for layer in range(upto + 1):
        consume(layer, h)
        if layer < upto:
            h = model.layer(layer, h, rope, batch, kv)
