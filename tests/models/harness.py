"""Drives the runner's tensor preparation and a model's run directly, over the caches the
engine would build (paged K/V, a state slot per sequence), keeping every row's logits: the
parity tests' harness, shared by every family. Unlike the single-sequence driver
(sequence_driver.py) it batches several sequences in one step, which is what those tests check."""

from __future__ import annotations

import torch

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.build import CacheBudget, build_caches
from ridgefill_runtime.cache.spec import spec_of
from ridgefill_runtime.models.forward import ForwardBatch
from ridgefill_runtime.runner import Runner
from ridgefill_runtime.scheduler import ScheduledSeq
from ridgefill_runtime.sequence import SamplingParams, Sequence

BLOCK = 16


class Harness:
    def __init__(
        self, model, num_blocks: int = 128, slots: int = 4, looped=None, history_rows: int = 0, device: str = "cpu"
    ):
        """`looped`: a looped model's stored planes (config.LoopConfig; None: the full cache)."""
        self.caches = build_caches(
            spec_of(model, looped),
            CacheBudget(block_size=BLOCK, num_blocks=num_blocks, state_slots=slots, history_rows=history_rows),
            device,
        )
        self.blocks = BlockManager(num_blocks, BLOCK)
        self.runner = Runner(model, self.caches, BLOCK)
        self.model = model
        self._next_slot = 0

    def new_seq(self, ids: list[int]) -> Sequence:
        seq = Sequence(prompt_ids=list(ids), params=SamplingParams(max_tokens=0))
        # NOTE: slots are reused round robin: a fresh prefill must not read what another left there.
        seq.state_slot = self._next_slot % self.caches.states.num_slots
        self._next_slot += 1
        return seq

    def items(self, spans: list[tuple[Sequence, int]]) -> list[ScheduledSeq]:
        """`n` more rows for each (seq, n), their blocks grown."""
        out = []
        for seq, n in spans:
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            out.append(ScheduledSeq(seq, seq.num_computed, n))
        return out

    def step(self, spans: list[tuple[Sequence, int]], reads: tuple | None = None) -> list[torch.Tensor]:
        """Compute `n` more rows for each (seq, n) in one flat batch; logits per seq.
        `reads`: a looped model's per-sequence loops and policy (ForwardBatch.loops)."""
        items = self.items(spans)
        ids, pos, batch = self.runner.prepare(items)
        logits = self.model.run(ForwardBatch(ids, pos, batch, self.caches, loops=reads)).logits
        for item in items:
            item.seq.num_computed = item.end
        return list(logits.split([n for _, n in spans]))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
