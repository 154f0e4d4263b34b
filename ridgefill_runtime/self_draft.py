"""Self-speculative drafting for looped models (seed 001 Algorithm 1, lines 2-4), run by the
runner before the step's verification pass.

For every item verifying γ draft tokens (placeholders from the scheduler), draft i is the argmax
of a d-loop pass on draft i-1 (draft 0 on the last known token x) that reads plane R of every
cached position (plane r for a request on the full policy). The γ passes are batched over all drafting sequences (one row each per pass);
a pass writes its prelude/coda K/V and its deepest-plane slot at its own position, which the
verification of [x, ŷ1..ŷγ] then overwrites. No scheduling state changes.
"""

from __future__ import annotations

import torch

from .layers.attention import kv_slots
from .layers.loop_attention import LoopRead
from .models.forward import ForwardBatch
from .ops.row_argmax import row_argmax
from .sequence import Sequence
from .step_layout import SeqLayout, attention_batch


def loop_read(seq: Sequence, draft: bool = False) -> LoopRead:
    """The sequence's loops and read policy this step (its draft pass when `draft`)."""
    plan, seed = seq.loop, seq.params.seed or 0
    if plan is None:
        raise ValueError("a looped model's sequence needs its loop plan (Engine.add_request sets it)")
    if draft:  # NOTE: drafts on a full policy read plane r, on any other plane R (seed 001 §3.3)
        return LoopRead(plan.draft_loops, None if plan.window is None else 0, draft=True, seed=seed)
    return LoopRead(plan.loops, plan.window, seed=seed)


class SelfDrafter:
    def __init__(self, model, caches, block_size: int):
        self.model, self.caches, self.block_size = model, caches, block_size

    def __call__(self, items, guide=None) -> dict[int, list[int]]:
        """Each drafting item's draft. `guide` (grammar/constrain.DraftGuide): structured
        outputs' masks on the draft passes of the sequences it constrains."""
        spec = [it for it in items if it.draft]
        drafts: dict[int, list[int]] = {it.seq.seq_id: [] for it in spec}
        for g in range(max(len(it.draft) for it in spec)):
            live = [it for it in spec if len(it.draft) > g]
            last = [it.token_ids()[0] if g == 0 else drafts[it.seq.seq_id][-1] for it in live]
            logits = self._pass(live, last, g)  # [len(live), V]
            ids = [it.seq.seq_id for it in live]
            if guide is not None:
                guide.mask(ids, logits)
            tokens = row_argmax(logits).tolist()
            if guide is not None:
                guide.take(ids, tokens)
            for seq_id, token in zip(ids, tokens):
                drafts[seq_id].append(token)
        return drafts

    def _pass(self, live, tokens: list[int], g: int) -> torch.Tensor:
        """One d-loop pass: row k is token k at position start + g of live[k]'s sequence."""
        device = self.model.device
        positions = torch.tensor([it.start + g for it in live], dtype=torch.int64)
        write, seqs = [], []
        for it, p in zip(live, positions.tolist()):
            table = torch.tensor(it.seq.block_table, dtype=torch.int64)
            write.append(kv_slots(table, torch.tensor([p]), self.block_size))
            seqs.append(
                SeqLayout(rows=1, context_len=p + 1, read_table=it.seq.block_table, state_slot=it.seq.state_slot)
            )
        # NOTE: no block tables: the pass's paged layers (prelude, coda) take the per-sequence path, not the batched kernel
        batch = attention_batch(seqs, torch.cat(write).to(device), block_size=self.block_size, device=device)
        reads = tuple(loop_read(it.seq, draft=True) for it in live)
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        out = self.model.run(ForwardBatch(ids, positions.to(device), batch, self.caches, None, None, reads))
        return out.logits
