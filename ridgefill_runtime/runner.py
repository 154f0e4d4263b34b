"""Turns a scheduled step into tensors, runs the model, samples. Changes no scheduling state."""

from __future__ import annotations

import torch

from .cache.kv_pool import KVPool
from .config import FillConfig
from .fill.plan import build_fill_step
from .layers.attention import AttentionBatch
from .sampling import sample_token
from .scheduler import ScheduledSeq, StepResult


class Runner:
    def __init__(self, model, kv: KVPool, block_size: int, fill: FillConfig | None = None, maps=None):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = model.device
        self.fill_config = fill or FillConfig()
        self.predict = _predictor(self.fill_config.arm, maps)
        self._generators: dict[int, torch.Generator] = {}

    def forward(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Run the step; logits [R, V] float32 and, per item, its (lo, hi) range of rows in them."""
        ids, positions, batch = self._prepare(items)
        fill = build_fill_step(items, batch, self._seq_slots, self.fill_config, self.predict)
        rows, owners = self._logit_rows(items, fill)
        return self.model.forward(ids, positions, batch, self.kv, rows, fill), owners

    def run(self, items: list[ScheduledSeq]) -> StepResult:
        logits, owners = self.forward(items)
        next_tokens: list[int | None] = []
        scores: list[tuple[list[float], list[int]] | None] = []
        for k, item in enumerate(items):
            lo, hi = owners[k]
            scored = item.seq.params.prompt_logprobs and item.end > item.seq.fill_boundary
            scores.append(self._prompt_scores(item, logits[lo:hi]) if scored else None)
            next_tokens.append(self._sample(item, logits[hi - 1]) if item.samples else None)
        return StepResult(next_tokens=next_tokens, prompt_logprobs=scores)

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    # -- building the step's tensors ----------------------------------------------------------

    def _prepare(self, items: list[ScheduledSeq]):
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        write: list[torch.Tensor] = []
        read: list[torch.Tensor | None] = []
        starts = [0]
        for item in items:
            seq = item.seq
            ids.extend(seq.tokens(item.start, item.end))
            p = torch.arange(item.start, item.end)
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            pos.append(p)
            write.append(self._slots(table, p))
            read.append(None if item.start == 0 else self._slots(table, torch.arange(item.end)).to(self.device))
            starts.append(starts[-1] + item.num_tokens)
        dev = self.device
        batch = AttentionBatch(query_starts=starts, context_lens=[it.end for it in items],
                               write_slots=torch.cat(write).to(dev), read_slots=read)
        return torch.tensor(ids, dtype=torch.int64, device=dev), torch.cat(pos).to(dev), batch

    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _seq_slots(self, seq, start: int, end: int) -> torch.Tensor:
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return self._slots(table, torch.arange(start, end)).to(self.device)

    def _logit_rows(self, items: list[ScheduledSeq], fill=None):
        """Rows needing logits (the last row of a sampling item, every row when scoring).

        With a fill step the indices are into fill.late_rows (filled rows have no logits);
        None means every row that reaches the top.
        """
        rows: list[torch.Tensor] = []
        owners: list[tuple[int, int]] = []
        offset = count = 0
        for item in items:
            if item.end <= item.seq.fill_boundary:  # a filled prefix item: no logits
                r = torch.empty(0, dtype=torch.int64)
            elif item.seq.params.prompt_logprobs:
                r = torch.arange(offset, offset + item.num_tokens)
            elif item.samples:
                r = torch.tensor([offset + item.num_tokens - 1])
            else:
                r = torch.empty(0, dtype=torch.int64)
            rows.append(r)
            owners.append((count, count + len(r)))
            count += len(r)
            offset += item.num_tokens
        top = offset if fill is None else len(fill.late_rows)
        if count == top:  # every row wanted (scoring): the plain causal path is faster
            return None, owners
        flat = torch.cat(rows).to(self.device)
        if fill is not None:
            flat = torch.searchsorted(fill.late_rows, flat)  # NOTE: late_rows is sorted
        return flat, owners

    # -- turning logits into results -------------------------------------------------------

    def _prompt_scores(self, item: ScheduledSeq, logits: torch.Tensor):
        """log p(next prompt token) and argmax for rows whose next token is a prompt token."""
        seq = item.seq
        n = max(0, min(item.end, len(seq.prompt_ids) - 1) - item.start)
        if n == 0:
            return [], []
        logp = logits[:n].log_softmax(-1)  # [n, V]
        targets = torch.tensor(seq.prompt_ids[item.start + 1:item.start + 1 + n], device=logits.device)
        chosen = logp.gather(1, targets[:, None])[:, 0]
        return chosen.tolist(), logp.argmax(-1).tolist()

    def _sample(self, item: ScheduledSeq, logits: torch.Tensor) -> int | None:
        params = item.seq.params
        if params.max_tokens == 0:
            return None
        gen = None
        if not params.greedy:
            gen = self._generators.get(item.seq.seq_id)
            if gen is None:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed(params.seed if params.seed is not None else torch.seed())
                self._generators[item.seq.seq_id] = gen
        return sample_token(logits, params, gen)


def _predictor(arm: str, maps):
    """How a filled row's late-layer input is predicted from its split state x_S."""
    if arm == "ridgefill":
        return maps.predict
    if arm == "identity":
        return lambda layer, x_split: x_split  # POP's fill: x̂_l = x_S
    return None  # exact never fills; nofill writes nothing
