"""Full logits of a prompt's exactly computed rows, through the engine's own runner: for the
evaluation tools and tests, which need whole distributions, not sampled tokens."""

from __future__ import annotations

import torch

from .cache.block_manager import BlockManager
from .cache.kv_pool import KVPool
from .config import FillConfig
from .runner import Runner
from .scheduler import ScheduledSeq
from .sequence import SamplingParams, Sequence


class PromptLogits:
    def __init__(self, model, fill: FillConfig | None = None, maps=None, chunk: int = 512, block_size: int = 16):
        self.model, self.fill, self.maps = model, fill or FillConfig(), maps
        self.chunk, self.block_size = chunk, block_size

    def new_sequence(self, ids: list[int]) -> Sequence:
        seq = Sequence(prompt_ids=list(ids), params=SamplingParams(max_tokens=0, prompt_logprobs=True))
        if self.fill.enabled and len(ids) > self.fill.tail:
            seq.fill_boundary, seq.fill_arm = len(ids) - self.fill.tail, self.fill.arm
        return seq

    def __call__(self, ids: list[int], after_fill=None, logits_from: int = 0
                 ) -> tuple[int, torch.Tensor, "Runner", Sequence]:
        """-> (first row with logits, logits [N - first, V], the runner holding the cache, the sequence).

        Logits start at the fill boundary, or at `logits_from` (whichever is later).
        after_fill(runner, seq), if given, runs once the prefix is filled and before the tail
        reads it (the splice measurements edit the filled cache there)."""
        cfg = self.model.config
        blocks = -(-len(ids) // self.block_size)
        kv = KVPool(cfg.num_layers, blocks * self.block_size, cfg.num_kv_heads, cfg.head_dim,
                    self.model.dtype, self.model.device)
        runner = Runner(self.model, kv, self.block_size, self.fill, self.maps)
        seq = self.new_sequence(ids)
        BlockManager(blocks, self.block_size).grow(seq.block_table, len(ids))
        parts = []
        first = max(seq.fill_boundary, logits_from)
        scoring, silent = seq.params, SamplingParams(max_tokens=0)
        while seq.num_computed < len(ids):
            n = min(self.chunk, len(ids) - seq.num_computed)
            stop = seq.fill_boundary if seq.num_computed < seq.fill_boundary else first
            if seq.num_computed < stop:
                n = min(n, stop - seq.num_computed)
            # NOTE: rows before `first` need no logits: the runner computes none for them.
            seq.params = scoring if seq.num_computed >= first else silent
            if after_fill is not None and seq.num_computed == seq.fill_boundary > 0:
                after_fill(runner, seq)
            item = ScheduledSeq(seq, seq.num_computed, n)
            logits, _ = runner.forward([item])
            if item.start >= first:
                parts.append(logits)
            seq.num_computed = item.end
        seq.params = scoring
        return first, torch.cat(parts), runner, seq
