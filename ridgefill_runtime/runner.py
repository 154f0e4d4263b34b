"""Turns a scheduled step into tensors, runs the model, samples. Changes no scheduling state.

The model sees one ForwardBatch and answers one ForwardOutput (models/forward.py); what the
fill measured in it (split states, selector attention) the runner itself keeps in the stash."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .cache.build import ModelCaches
from .cache.split_stash import SplitStash
from .config import FillConfig
from .decode_graphs import DecodeGraphs
from .fill.plan import FillPlanner, PlannedFill, needs_fill_step
from .fill.two_sweep import two_sweep
from .layers.attention import AttentionBatch, kv_slots
from .models.forward import ForwardBatch, ForwardOutput
from .ops.row_argmax import row_argmax
from .sampling import sample_token
from .self_draft import SelfDrafter, loop_read
from .speculative import accept_greedy
from .scheduler import ScheduledSeq, StepResult
from .sequence import TokenLogprobs
from .stages import Stage
from .step_layout import SeqLayout, attention_batch, padded_block_tables

if TYPE_CHECKING:
    from .grammar.constrain import Constrainer


@dataclass(frozen=True)
class StepLogits:
    """A step's forward as the runner's callers see it, one entry per item where a list."""

    logits: torch.Tensor  # [R, V] float32
    owners: list[tuple[int, int]]  # each item's (lo, hi) range of rows in logits
    row_scores: list[dict[str, list[float]] | None]  # selector scores per prefix row the step finished
    drafts: dict[int, list[int]] | None = None  # seq_id -> the tokens a looped model drafted for itself


class Runner:
    def __init__(
        self,
        model,
        caches: ModelCaches,
        block_size: int,
        fill: FillConfig | None = None,
        maps=None,
        defer_windows: bool = False,
        graphs: DecodeGraphs | None = None,
        constrainer: Constrainer | None = None,
    ):
        """`caches`: what build_caches made for this model. defer_windows: the fill writes a filled
        row's K/V at sliding-window late layers only once a later row reaches it (fill/plan.py);
        only where nothing else reads the filled cache (no prefix cache, no splice, no replay).
        `graphs`: captured decode steps (decode_graphs.py) that plain decode steps replay.
        `constrainer`: structured outputs' matchers (grammar/constrain.py); None: no grammars."""
        self.model = model
        self.graphs = graphs
        self.caches = caches
        self.kv = self.caches.kv
        self.states = self.caches.states  # recurrent states and split-state stashes, by state slot
        self.block_size = block_size
        self.device = model.device
        self.fill_config = fill or FillConfig()
        self.predict = _predictor(self.fill_config.arm, maps)
        self._generators: dict[int, torch.Generator] = {}
        self.constrainer = constrainer
        # NOTE: with maps holding ΔM any request may ask for the correction (Sequence.fill.terminal_state)
        self.has_terminal_shift = _holds_terminal_shift(maps, self.caches.spec, self.fill_config.split)
        terminal = maps.terminal_shift if self.has_terminal_shift else None
        self.looped = model.config.family_config.looped
        self.drafter = SelfDrafter(model, self.caches, self.block_size) if self.looped else None
        self.planner = FillPlanner(
            self.fill_config,
            self.predict,
            self._seq_slots_at,
            self.states,
            model.config,
            model.dtype,
            self.device,
            self.caches.spec.attention_layers,
            terminal,
            defer_windows,
        )

    def forward(self, items: list[ScheduledSeq]) -> StepLogits:
        """Run the step's model call (a looped model's self-drafts first) and keep what the fill
        measured in it."""
        copies = [pair for it in items for pair in it.copies]
        if copies:  # NOTE: before anything this step writes: the copies are of shared blocks
            self.kv.copy_blocks(copies, self.block_size)
        for it in items:  # NOTE: before any snapshot this step writes, which may reuse the slot read here
            if it.restore is not None:
                self.states.load_snapshot(it.restore, it.seq.state_slot)
        if self._graphed(items):
            ids, positions, batch = self.prepare(items)
            return StepLogits(
                self.graphs.run(ids, positions, batch), [(k, k + 1) for k in range(len(items))], [None] * len(items)
            )
        drafts = None
        if self.drafter is not None and any(it.draft for it in items):
            guide = self.constrainer.draft_guide(items) if self.constrainer is not None else None
            drafts = self.drafter(items, guide)
        ids, positions, batch = self.prepare([it for it in items if it.kind.from_tokens], drafts)
        plan = self.planner.build(items, batch) if needs_fill_step(items) else None
        rows, owners = self._logit_rows(items)
        step = ForwardBatch(
            ids, positions, batch, self.caches, rows, None if plan is None else plan.step, self._loop_reads(items)
        )
        # NOTE: the two-sweep prefill is the fill's driver over the model's hooks, not the model's forward
        out = self.model.run(step) if plan is None else two_sweep(self.model, step)
        return StepLogits(out.logits, owners, self._keep_fill_outputs(items, plan, out), drafts)

    def _graphed(self, items: list[ScheduledSeq]) -> bool:
        """A plain decode step the captured graphs replay: each item one sampled row at its next
        position (nothing scored, no draft to verify, no fill stage), tables no wider than theirs."""
        if self.graphs is None or not items:
            return False
        plain = all(
            it.kind is Stage.FULL
            and it.num_tokens == 1
            and it.start > 0
            and it.positions is None
            and not it.draft
            and it.samples
            and not _scored(it)
            for it in items
        )
        return plain and self.graphs.fits(len(items), max(len(it.seq.block_table) for it in items))

    def run(self, items: list[ScheduledSeq]) -> StepResult:
        step = self.forward(items)
        for it in items:  # the recurrent states after the step's last row, for the prefix cache
            if it.snapshot is not None:
                self.states.save_snapshot(it.seq.state_slot, it.snapshot)
        logits, owners = step.logits, step.owners
        next_tokens: list[list[int] | None] = []
        scores: list[tuple[int, list[float], list[int]] | None] = []
        raw, dead = logits, set()
        if self.constrainer is not None and self.constrainer.any_constrained(items):
            if any(it.seq.params.logprobs is not None for it in items):
                raw = logits.clone()  # NOTE: reported logprobs are the model's, before the grammar's mask
            # NOTE: before the greedy choices: a constrained row's argmax is over the tokens its grammar allows
            dead = self.constrainer.mask(items, owners, logits, step.drafts or {})
        greedy = _greedy_choices(items, owners, logits)
        for k, item in enumerate(items):
            lo, hi = owners[k]
            scores.append(self._prompt_scores(item, logits[lo:hi]) if _scored(item) else None)
            draft = (step.drafts or {}).get(item.seq.seq_id, item.draft)  # a looped model's own, else the scheduler's
            sampled = range(hi - item.num_sampled, hi)
            next_tokens.append(
                self._accepted(item, draft, logits[sampled.start : hi], [greedy.get(r) for r in sampled])
                if item.samples and item.seq.seq_id not in dead
                else None
            )
        # NOTE: before the logprobs: the grammar may cut an accepted run at its end
        ended = self.constrainer.advance(items, next_tokens, dead) if self.constrainer is not None else {}
        return StepResult(
            next_tokens=next_tokens,
            prompt_logprobs=scores,
            row_scores=step.row_scores,
            token_logprobs=_token_logprobs(items, owners, next_tokens, raw),
            ended=ended,
        )

    def forget(self, seq_id: int) -> None:
        """NOTE: only the sampler's state: what the caches keep goes with the sequence's state
        slot, which the scheduler's cache manager frees."""
        self._generators.pop(seq_id, None)
        if self.constrainer is not None:
            self.constrainer.forget(seq_id)

    def stash(self, seq) -> SplitStash | None:
        return self.states.stash(seq.state_slot)

    def put_stash(self, seq, stash: SplitStash) -> None:
        """Evaluation: restart a sequence's late sweep from a saved lower sweep."""
        self.states.put_stash(seq.state_slot, stash)

    def _keep_fill_outputs(self, items, plan: PlannedFill | None, out: ForwardOutput) -> list[dict | None]:
        """Store what the model measured for the fill in the stashes; per item, the selector
        scores finished this step."""
        if plan is not None:
            _add_key_mass(plan.step.lower.mass, out.lower_mass, plan.lower_mass_into)
            _add_key_mass(plan.step.late.mass, out.late_mass, plan.late_mass_into)
        return self._after_step(items, out.split_states)

    def _after_step(self, items, split_states: torch.Tensor | None) -> list[dict | None]:
        """Keep the split states [X, d] of this step's lower rows; hand back finished selector
        scores. NOTE: the stash outlives the prefill's last step here; the cache manager's
        settle() frees it once the step's results are in."""
        out: list[dict | None] = []
        offset = 0
        for item in items:
            seq, scores = item.seq, None
            stash = self.states.stash(seq.state_slot)
            if item.kind is Stage.LOWER or item.kind is Stage.RECOVER:
                at = slice(item.start, item.end) if item.positions is None else torch.tensor(item.positions)
                stash.x[at] = split_states[offset : offset + item.num_tokens]
                offset += item.num_tokens
                if item.end == seq.num_tokens and seq.fill.rows.lower_attention:
                    scores = {"attention": stash.attention.tolist()}
            elif item.kind is Stage.PROBE and seq.fill.queue_done + item.num_tokens == len(seq.fill.queue):
                scores = {"probe": stash.probe.tolist()}
            out.append(scores)
        return out

    # -- building the step's tensors ----------------------------------------------------------

    def _loop_reads(self, items: list[ScheduledSeq]):
        """A looped model's per-sequence loops and read policy (None for other models)."""
        if not self.looped:
            return None
        return tuple(loop_read(it.seq) for it in items)

    def prepare(
        self, items: list[ScheduledSeq], drafts: dict[int, list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """The step's rows, positions and attention layout: the one place its metadata is built.
        Returns the items' token ids [N] and positions [N] (int64, on the runner's device, item
        after item) and their AttentionBatch (K/V write slots, block tables, per-item layout).
        `drafts`: a looped model's own drafts by seq_id, replacing a speculating item's draft
        placeholders. Each item's blocks must already hold it (CacheManager.prepare). Public for
        the callers that run the model's layers themselves (SequenceDriver.tensors, the parity
        tests), so their rows sit in the cache where a step's would."""
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        write: list[torch.Tensor] = []
        seqs: list[SeqLayout] = []
        dev = self.device
        tables = padded_block_tables([it.seq.block_table for it in items])  # [B, max_blocks] int32
        for item, table in zip(items, tables):
            seq = item.seq
            tokens = item.token_ids()  # NOTE: a speculating decode ends with its draft
            if drafts and seq.seq_id in drafts:  # a looped model's own draft replaces the placeholders
                tokens = tokens[: len(tokens) - len(item.draft)] + drafts[seq.seq_id]
            ids.extend(tokens)
            # NOTE: a recover item's rows are scattered positions, each reading the cache up to itself
            p = torch.arange(item.start, item.end) if item.positions is None else torch.tensor(item.positions)
            pos.append(p)
            write.append(kv_slots(table.long(), p, self.block_size))
            seqs.append(
                SeqLayout(
                    rows=item.num_tokens,
                    context_len=item.end,
                    # NOTE: a fresh prefill (start 0) has all its K/V in hand and reads no cache
                    read_table=None if item.start == 0 and item.positions is None else seq.block_table,
                    query_pos=None if item.positions is None else p.to(dev),
                    state_slot=seq.state_slot,
                    verifies=bool(item.draft),
                )
            )
        cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64)  # noqa: E731
        batch = attention_batch(
            seqs, cat(write).to(dev), block_size=self.block_size, device=dev, block_tables=tables.to(dev)
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), cat(pos).to(dev), batch

    def _seq_slots(self, seq, start: int, end: int) -> torch.Tensor:
        return self._seq_slots_at(seq, torch.arange(start, end))

    def _seq_slots_at(self, seq, positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(seq.block_table, dtype=torch.int64, device=positions.device)
        return kv_slots(table, positions, self.block_size).to(self.device)

    def _logit_rows(self, items: list[ScheduledSeq], fill=None):
        """Rows needing logits: the last row of a sampling item, every row (from the fill
        boundary on) when scoring. Indices are into the rows reaching the top layer: every row
        without a fill step, the late part with one (lower and probe items reach no logits).
        None means every row that reaches the top.
        """
        rows: list[torch.Tensor] = []
        owners: list[tuple[int, int]] = []
        offset = count = 0
        for item in items:
            if not item.kind.reaches_top:
                owners.append((count, count))
                continue
            if _scored(item):
                r = torch.arange(offset + _first_scored(item), offset + item.num_tokens)
            elif item.samples:
                r = torch.arange(offset + item.num_tokens - item.num_sampled, offset + item.num_tokens)
            else:
                r = torch.empty(0, dtype=torch.int64)
            rows.append(r)
            owners.append((count, count + len(r)))
            count += len(r)
            offset += item.num_tokens
        if count == offset and offset > 0:  # every row wanted (scoring): the plain causal path is faster
            return None, owners
        flat = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
        return flat.to(self.device), owners

    # -- turning logits into results -------------------------------------------------------

    def _prompt_scores(self, item: ScheduledSeq, logits: torch.Tensor):
        """(first position, log p(next prompt token), argmax) for the item's scored rows whose
        next token is a prompt token. Scored rows are contiguous: positions start..end-1."""
        seq = item.seq
        start = item.end - logits.shape[0]
        n = max(0, min(item.end, len(seq.prompt_ids) - 1) - start)
        if n == 0:
            return start, [], []
        logp = logits[:n].log_softmax(-1)  # [n, V]
        targets = torch.tensor(seq.prompt_ids[start + 1 : start + 1 + n], device=logits.device)
        chosen = logp.gather(1, targets[:, None])[:, 0]
        k = seq.params.prompt_top_logprobs
        if not k:
            return start, chosen.tolist(), row_argmax(logp).tolist()
        top = logp.topk(k, -1)
        return start, chosen.tolist(), row_argmax(logp).tolist(), _pairs(top.indices, top.values)

    def _accepted(
        self, item: ScheduledSeq, draft: list[int], logits: torch.Tensor, greedy: list[int | None]
    ) -> list[int] | None:
        """The item's new tokens from its sampled rows' logits [1 + len(draft), V] (`greedy`: their
        argmax, None for a sampling item): one sampled token, or, verifying a draft (greedy
        only), the accepted run."""
        if not draft:
            token = self._sample(item, logits[-1], greedy[-1])
            return None if token is None else [token]
        return accept_greedy(draft, greedy)

    def _sample(self, item: ScheduledSeq, logits: torch.Tensor, argmax: int | None) -> int | None:
        """One token from a row's logits [V]; a greedy item takes the step's `argmax` of it."""
        params = item.seq.params
        if params.max_tokens == 0:
            return None
        if params.greedy:
            return argmax
        gen = self._generators.get(item.seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=logits.device)
            gen.manual_seed(params.seed if params.seed is not None else torch.seed())
            self._generators[item.seq.seq_id] = gen
        return sample_token(logits, params, gen)


def _greedy_choices(items: list[ScheduledSeq], owners: list[tuple[int, int]], logits: torch.Tensor) -> dict[int, int]:
    """logit row -> its argmax, for the sampled rows of greedy items, in one reduction.
    NOTE: one call for the step instead of one per sequence (at batch 16 those cost ~2 ms a step),
    and row_argmax rather than torch's argmax: the same first-maximum index, by block maxima
    (Gemma 3's [16, 262144] logits: ~0.2 ms against ~1.8 ms)."""
    rows = [
        r
        for it, (_, hi) in zip(items, owners)
        if it.samples and (it.seq.params.greedy or it.num_sampled > 1)  # > 1: verifying a draft
        for r in range(hi - it.num_sampled, hi)
    ]
    if not rows:
        return {}
    picked = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
    return dict(zip(rows, row_argmax(picked).tolist()))


def _token_logprobs(
    items: list[ScheduledSeq], owners: list[tuple[int, int]], runs: list[list[int] | None], logits: torch.Tensor
) -> dict[int, list[TokenLogprobs]]:
    """seq_id -> one TokenLogprobs per token of its run, for the items whose request asked
    (params.logprobs). Token j of a run was chosen from the item's j-th sampled row (a verified
    draft's accepted run included), so its values come from that row's raw logits. One
    log_softmax and one top-k over every such row of the step, not one per token."""
    rows: list[int] = []
    tokens: list[int] = []
    asking: list[tuple[ScheduledSeq, int]] = []  # (item, tokens in its run)
    for item, (_, hi), run in zip(items, owners, runs):
        if run and item.seq.params.logprobs is not None:
            first = hi - item.num_sampled
            rows.extend(range(first, first + len(run)))
            tokens.extend(run)
            asking.append((item, len(run)))
    if not rows:
        return {}
    logp = logits[torch.tensor(rows, device=logits.device)].float().log_softmax(-1)  # [T, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    k = max(item.seq.params.logprobs or 0 for item, _ in asking)  # every asking item has logprobs set
    if k:
        best = logp.topk(k, -1)
        top = _pairs(best.indices, best.values)
    else:
        top = [()] * len(rows)
    out: dict[int, list[TokenLogprobs]] = {}
    at = 0
    for item, count in asking:
        want = item.seq.params.logprobs
        out[item.seq.seq_id] = [TokenLogprobs(tokens[i], chosen[i], top[i][:want]) for i in range(at, at + count)]
        at += count
    return out


def _pairs(ids: torch.Tensor, values: torch.Tensor) -> list[tuple[tuple[int, float], ...]]:
    """Rows of top-k (ids [T, k], logprobs [T, k]) as tuples of (id, logprob) pairs."""
    return [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def _scored(item: ScheduledSeq) -> bool:
    """Scoring requests get logits for every row from the fill boundary on."""
    return item.seq.params.prompt_logprobs and item.kind.reaches_top and item.end > item.seq.fill.boundary


def _first_scored(item: ScheduledSeq) -> int:
    """Index, within the item, of its first row at or after the fill boundary (late items
    hold exact prefix rows first, then tail rows)."""
    if item.positions is None:
        return max(0, item.seq.fill.boundary - item.start)
    return sum(p < item.seq.fill.boundary for p in item.positions)


def _add_key_mass(requests, found, into) -> None:
    """Per mass request, add the attention its prefix keys received at each layer, in layer
    order (the order one in-model pass would add them), into its stash accumulator [boundary]."""
    for request, per_layer, acc in zip(requests, found, into):
        keep = request.key_pos < acc.shape[0]  # [K] prefix keys only
        at = request.key_pos[keep]
        for mass in per_layer:
            acc.index_add_(0, at, mass[keep])


def _holds_terminal_shift(maps, spec, split: int) -> bool:
    """The maps hold a ΔM for every recurrent layer above the split (there is one at least)."""
    late = [layer for layer in spec.recurrent_layers if layer >= split]
    return bool(late) and maps is not None and all(layer in getattr(maps, "terminal", {}) for layer in late)


def _predictor(arm: str, maps):
    """How a filled row's late-layer input is predicted from its split state x_S."""
    if arm == "ridgefill":
        return maps.predict
    if arm == "identity":
        return lambda layer, x_split: x_split  # POP's fill: x̂_l = x_S
    return None  # exact never fills; nofill writes nothing
