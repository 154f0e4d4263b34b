"""Run a document exactly and hand each layer's input to a consumer as it is computed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..scheduler import ScheduledSeq
from ..sequence import SamplingParams, Sequence
from ..sequence_driver import SequenceDriver


def document_driver(model, ids: list[int], num_layers: int | None = None) -> SequenceDriver:
    """A driver holding the document `ids` as one sequence, nothing computed yet; caches for the
    first `num_layers` layers (None: every layer)."""
    seq = Sequence(prompt_ids=list(ids), params=SamplingParams(max_tokens=0))
    seq.start_prefill()
    return SequenceDriver(model, seq, num_layers=num_layers)


@torch.inference_mode()
def run_layer_inputs(
    model, ids: list[int], consume: Callable[[int, torch.Tensor], None], upto: int | None = None
) -> None:
    """Exact prefill of one sequence; calls consume(layer, x_layer [n, d]) for each layer
    input 0..upto (default: every layer), in order. NOTE: only the layers run get a cache."""
    upto = model.config.num_layers - 1 if upto is None else upto
    layer_inputs(model, document_driver(model, ids, upto + 1), consume, upto)


@torch.inference_mode()
def layer_inputs(
    model, drive: SequenceDriver, consume: Callable[[int, torch.Tensor], None], upto: int | None = None
) -> None:
    """run_layer_inputs over the driver's sequence, its whole prompt in one step.
    NOTE: layer by layer through the model's pieces (embed, rope, layer), as the map fit needs
    every layer's input; the step's tensors and cache are the driver's, so each layer computes
    what the model's own run computes."""
    upto = model.config.num_layers - 1 if upto is None else upto
    ids, positions, batch = drive.tensors(ScheduledSeq(drive.seq, 0, drive.seq.num_tokens))
    h = model.embed(ids)  # [n, d]
    rope = model.rope(positions)
    for layer in range(upto + 1):
        consume(layer, h)
        if layer < upto:
            h = model.layer(layer, h, rope, batch, drive.caches)
