"""One sequence run alone through the engine's own pieces, for the tools that need more than the
engine's sampled tokens: whole logits (offline.py), the evaluation's shared lower sweep
(eval/sessions.py), the map fit's layer inputs (fill/capture.py) and the tests built on them.

Its caches are what build_caches makes for the model, sized for this one sequence; its blocks and
state slot come from the cache manager, as the scheduler takes them; each step's tensors are the
Runner's, and the model runs through its one entry, LanguageModel.run. What these tools measure is
then what the server runs, and nothing but the cache writes into the cache.
"""

from __future__ import annotations

import torch

from .cache.build import CacheBudget, build_caches
from .cache.spec import spec_of
from .config import CacheConfig, FillConfig
from .layers.attention import AttentionBatch
from .models.forward import LanguageModel
from .runner import Runner, StepLogits
from .scheduler import ScheduledSeq, StepResult
from .sequence import Sequence

# NOTE: the engine's default block size, so a driven sequence sits in the cache as a served one does
BLOCK_SIZE = CacheConfig().block_size


class SequenceDriver:
    """Holds one sequence's caches and runner; steps are the caller's (stages.next_item items)."""

    def __init__(
        self,
        model: LanguageModel,
        seq: Sequence,
        fill: FillConfig | None = None,
        maps=None,
        *,
        max_tokens: int | None = None,
        block_size: int = BLOCK_SIZE,
        defer_windows: bool = False,
        num_layers: int | None = None,
    ):
        """Admits `seq` (started: Sequence.start_prefill) into caches with room for `max_tokens`
        positions (None: its known tokens). fill, maps, defer_windows: the Runner's. num_layers:
        only the first layers get a cache (None: every layer), for a caller that runs no later one."""
        room = seq.num_tokens if max_tokens is None else max_tokens
        if room < seq.num_tokens:
            raise ValueError(f"max_tokens {room} is below the sequence's {seq.num_tokens} known tokens")
        self.model, self.seq = model, seq
        spec = spec_of(model) if num_layers is None else spec_of(model).first_layers(num_layers)
        self.caches = build_caches(spec, CacheBudget.for_tokens(room, block_size), model.device)
        self.manager = self.caches.manager()
        self.runner = Runner(model, self.caches, block_size, fill, maps, defer_windows=defer_windows)
        self.manager.allocate(seq, seq.num_tokens)

    def forward(self, item: ScheduledSeq) -> StepLogits:
        """One step of the sequence, its logits as the runner's callers see them."""
        return self.runner.forward([self._prepared(item)])

    def run(self, item: ScheduledSeq) -> StepResult:
        """One step of the sequence, sampled as the engine samples."""
        return self.runner.run([self._prepared(item)])

    def settle(self) -> None:
        """After a step, as the scheduler does: the stash goes once the two-sweep prefill is over."""
        self.manager.settle(self.seq)

    def tensors(self, item: ScheduledSeq) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """The item's rows [N] and positions [N] (int64) and their attention layout, as a step
        hands them to the model: for the map fit, which runs the model's layers one at a time.
        NOTE: the Runner's own preparation, so these rows sit in the cache where a step's would."""
        return self.runner.prepare([self._prepared(item)])

    def _prepared(self, item: ScheduledSeq) -> ScheduledSeq:
        """The item, once the cache manager has grown the sequence's blocks to hold it."""
        if item.seq is not self.seq:
            raise ValueError(f"this driver runs sequence {self.seq.seq_id}, not {item.seq.seq_id}")
        self.manager.prepare(item)
        return item
