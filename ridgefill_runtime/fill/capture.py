"""Run a document exactly and hand each layer's input to a consumer as it is computed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache.build import CacheBudget, build_caches
from ..cache.spec import spec_of
from ..layers.attention import AttentionBatch


@torch.inference_mode()
def run_layer_inputs(
    model, ids: list[int], consume: Callable[[int, torch.Tensor], None], upto: int | None = None
) -> None:
    """Exact prefill of one sequence; calls consume(layer, x_layer [n, d]) for each layer
    input 0..upto (default: every layer), in order. Uses a private scratch cache."""
    cfg = model.config
    n = len(ids)
    upto = cfg.num_layers - 1 if upto is None else upto
    # NOTE: one block of n slots, so slot p holds position p; only the layers run get a cache
    caches = build_caches(spec_of(model).first_layers(upto + 1), CacheBudget(block_size=n, num_blocks=1), model.device)
    positions = torch.arange(n, device=model.device)
    batch = AttentionBatch(
        query_starts=[0, n], context_lens=[n], write_slots=positions, read_slots=[None], state_slots=[0]
    )
    h = model.embed(torch.tensor(ids, device=model.device))
    rope = model.rope(positions)
    for layer in range(upto + 1):
        consume(layer, h)
        if layer < upto:
            h = model.layer(layer, h, rope, batch, caches)
