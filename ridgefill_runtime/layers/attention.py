"""Causal self-attention over the paged KV cache for a flat batch of variable-length rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from ..ops.scattered_rows_attention import compiled_for, scattered_rows_attention
from .window_attention import banded_window_attention, worth_banding

# On the CPU a sequence with more rows than this in one step (a prefill chunk) keeps its own
# gather + SDPA call, whose blocked GEMMs beat the row-wise kernel there; on a GPU every cached
# row goes to the batched kernel.
CPU_PAGED_MAX_ROWS = 32


def kv_slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots [n] int64 of positions [n] under one sequence's block table [blocks] int64:
    position p lives at offset p % block_size of block table[p // block_size]."""
    return table[positions // block_size] * block_size + positions % block_size


@dataclass(frozen=True)
class AttentionBatch:
    """Where each sequence's rows sit in the flat batch and where its K/V live. Built by
    step_layout.attention_batch from each sequence's layout.

    Sequence i owns rows query_starts[i]:query_starts[i+1]; they are its last positions,
    so it sees positions 0..context_lens[i]-1 after this step's rows are written.
    """

    query_starts: list[int]  # [B+1]
    context_lens: list[int]  # [B]
    write_slots: torch.Tensor  # [N] int64, cache slot of each row
    read_slots: ContextSlots  # per sequence the slots [K_i] int64 of its keys; None: all context is in this step
    # Scattered rows (RidgeFill's exact prefix rows, the probe): per sequence the rows' own
    # positions [n_i] and the positions of the keys in read_slots [ctx_i]; a row sees the keys
    # at positions <= its own. None: the rows are the last positions and keys are 0..ctx-1.
    query_pos: list[torch.Tensor | None] | None = None
    key_pos: list[torch.Tensor | None] | None = None
    # Per sequence, its row in the state pool (layers that keep a recurrent state read it);
    # None where the step's rows keep no per-sequence state.
    state_slots: list[int | None] | None = None
    # Per sequence, whether its recurrent states start from zero at its first row this step; None:
    # where its rows start at position 0 (the probe starts a scratch state mid-sequence).
    state_fresh: list[bool] | None = None
    # Per sequence, whether its rows verify a speculative draft: a recurrent layer then keeps
    # its state after every row (StatePool.history) so the rejected rows can be rolled back.
    verifies: list[bool] | None = None
    # The paged cache's layout, for the batched kernel: int32 [B, max_blocks] block tables (each
    # padded with 0) and the block size; None where every sequence attends on its own path.
    block_tables: torch.Tensor | None = None
    block_size: int = 0
    # The batched kernel's rows, given rather than built from the lists above: a replayed decode
    # graph (decode_graphs.py) keeps them in its static buffers, as no host list may feed a graph.
    paged_given: PagedRows | None = None
    # (sequence, window) -> what _seen_by found for it: every windowed layer of the step asks the same
    _seen: dict = field(default_factory=dict, repr=False, compare=False)

    def seen_by_window(self, i: int, window: int) -> torch.Tensor:
        """[P] bool by position: inside some scattered row of sequence i's window (built once a step)."""
        key = (i, window)
        if key not in self._seen:
            q_pos = self.query_pos[i]
            self._seen[key] = _seen_by(q_pos, window, int(q_pos.max()) + 1)
        return self._seen[key]

    @cached_property
    def paged(self) -> PagedRows | None:
        """Which rows the batched paged kernel serves this step, built once and read by every layer."""
        return self.paged_given if self.paged_given is not None else paged_rows(self)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def reads_cache(self, i: int) -> bool:
        """Sequence i reads K/V from the cache (not all of its context is in this step)."""
        return self.read_slots.reads(i)

    def scattered(self, i: int) -> bool:
        return self.query_pos is not None and self.query_pos[i] is not None

    def first_row_position(self, i: int) -> int:
        """The lowest position among sequence i's rows (no tensor built for ordinary rows)."""
        if self.scattered(i):
            return int(self.query_pos[i].min())
        return self.context_lens[i] - (self.query_starts[i + 1] - self.query_starts[i])

    def row_positions(self, i: int, device) -> torch.Tensor:
        """Positions [n_i] of sequence i's rows."""
        if self.scattered(i):
            return self.query_pos[i]  # type: ignore[return-value]  # scattered(i): query_pos[i] is set
        lo, hi = self.query_starts[i], self.query_starts[i + 1]
        return torch.arange(self.context_lens[i] - (hi - lo), self.context_lens[i], device=device)


class ContextSlots:
    """An AttentionBatch's read_slots: per sequence, the cache slots its rows read keys from, or
    None where all of its context is in this step (a fresh prefill reads no cache).

    A sequence reading positions 0..ctx_i-1 through its block table (`tables`) has its slots made
    on first use: the batched kernel reads the tables themselves, so a decode step builds no
    per-position list; only the per-sequence paths (a prefill chunk, a draft pass) gather and ask
    for one. A sequence reading chosen keys (the fill's late part, AttentionBatch.key_pos) comes
    with its slots made (`given`)."""

    def __init__(
        self,
        tables: list[list[int] | None],
        lens: list[int],
        block_size: int,
        device,
        given: list[torch.Tensor | None] | None = None,
    ):
        given = given if given is not None else [None] * len(tables)
        if not len(tables) == len(lens) == len(given):
            raise ValueError(f"ContextSlots: {len(tables)} tables, {len(lens)} lengths, {len(given)} given slot lists")
        if any(t is not None and s is not None for t, s in zip(tables, given)):
            raise ValueError("ContextSlots: a sequence reads through its block table or from given slots, not both")
        self._tables, self._lens, self._block, self._device = tables, lens, block_size, device
        self._made: dict[int, torch.Tensor] = {i: s for i, s in enumerate(given) if s is not None}

    def __len__(self) -> int:
        return len(self._tables)

    def reads(self, i: int) -> bool:
        return self._tables[i] is not None or i in self._made

    def __getitem__(self, i: int) -> torch.Tensor | None:
        """Slots [K_i] int64 (positions 0..ctx_i-1 through the table); None: all of the context is
        in this step."""
        if i not in self._made:
            if self._tables[i] is None:
                return None
            table = torch.tensor(self._tables[i], dtype=torch.int64)
            self._made[i] = kv_slots(table, torch.arange(self._lens[i]), self._block).to(self._device)
        return self._made[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True)
class PagedRows:
    """Per row of the step: its sequence and position; per sequence: whether its rows attend
    in the one batched call (they read K/V through the block tables, nothing is gathered)."""

    owner: torch.Tensor  # [N] int32 sequence of each row (the kernel's q_seq)
    pos: torch.Tensor  # [N] int64 position of each row
    served: torch.Tensor  # [B] bool: the sequence's rows go to the batched kernel
    served_seqs: tuple[bool, ...]  # the same, read by each layer's per-sequence loop
    all_served: bool
    context_lens: torch.Tensor  # [B] int32


def paged_rows(batch: AttentionBatch) -> PagedRows | None:
    """None when no sequence can use the batched kernel (no block tables, no compiled kernel, or
    every sequence is a fresh prefill or a chunk that keeps the SDPA path)."""
    if batch.block_tables is None or not compiled_for(batch.block_tables.device):
        return None
    device = batch.block_tables.device
    served, owner, pos = [], [], []
    for i in range(batch.num_seqs):
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        custom_keys = batch.key_pos is not None and batch.key_pos[i] is not None
        chunk = device.type == "cpu" and hi - lo > CPU_PAGED_MAX_ROWS
        served.append(batch.reads_cache(i) and not custom_keys and not chunk)
        owner.append(torch.full((hi - lo,), i, dtype=torch.int32))
        pos.append(
            batch.query_pos[i].cpu()
            if batch.scattered(i)
            else torch.arange(batch.context_lens[i] - (hi - lo), batch.context_lens[i])
        )
    if not any(served):
        return None
    cat = lambda xs, dtype: torch.cat(xs).to(device) if xs else torch.empty(0, dtype=dtype, device=device)  # noqa: E731
    return PagedRows(
        owner=cat(owner, torch.int32),
        pos=cat(pos, torch.int64),
        served=torch.tensor(served, device=device),
        served_seqs=tuple(served),
        all_served=all(served),
        context_lens=torch.tensor(batch.context_lens, dtype=torch.int32, device=device),
    )


def _batched_for(q: torch.Tensor, batch: AttentionBatch) -> bool:
    """NOTE: the kernels take float32/bfloat16/float16; a float64 run (the tests' references)
    keeps the per-sequence path."""
    return q.dtype != torch.float64 and batch.paged is not None


def _batched(
    q: torch.Tensor, rows: torch.Tensor | None, kv, layer: int, batch: AttentionBatch, scale: float, window: int = 0
):
    """The batched kernel over step rows `rows` [R] (None: all N); q holds those rows [R, H, D].
    Returns (out [R', H*D] for the served ones, their indices into q [R'] or None when all)."""
    paged = batch.paged
    owner = paged.owner if rows is None else paged.owner[rows]  # [R]
    pos = paged.pos if rows is None else paged.pos[rows]
    pick = None
    if not paged.all_served:
        pick = paged.served[owner].nonzero().flatten()  # [R']
        q, owner, pos = q[pick], owner[pick], pos[pick]
    # NOTE: a window-bounded pool pages a sliding-window layer apart (cache/kv_layout.py)
    tables = kv.block_tables(layer, batch.block_tables)  # [B, max_blocks] int32
    # NOTE: a narrower K/V cache (cache.kv_dtype) is read as stored; float32 queries stay float32
    k_scale, v_scale = kv.scales(layer)  # an int8 cache's [slots, Hkv] scales, else None
    out, _ = scattered_rows_attention(
        q, owner, pos, kv.k[layer], kv.v[layer], tables, paged.context_lens, batch.block_size, scale,
        window=window, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    # NOTE: explicit widths: no row may be served (logit rows all in long chunks), and [0, -1] is ambiguous
    return out.reshape(q.shape[0], q.shape[1] * q.shape[2]), pick


def causal_offset_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, k_len] bool, True where allowed; queries are the last q_len of k_len positions."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return k_pos <= q_pos


def _ascending(q_pos: torch.Tensor, k_pos: torch.Tensor | None) -> bool:
    """Rows q_pos [R] and keys k_pos [Lk] (None: 0..Lk-1) in ascending position: the order
    banded_window_attention takes."""
    return bool((q_pos.diff() > 0).all()) and (k_pos is None or bool((k_pos.diff() > 0).all()))


def attend_at(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    k_pos: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Chosen query rows q [R, H, D] at positions q_pos [R] over k/v [Lk, Hkv, D] whose
    positions are k_pos [Lk] (None: 0..Lk-1); a row sees keys at positions <= its own (and,
    with a window, > its own - window)."""
    if worth_banding(q.shape[0], k.shape[0], window) and _ascending(q_pos, k_pos):
        keys_at = torch.arange(k.shape[0], device=q.device) if k_pos is None else k_pos
        return banded_window_attention(q, q_pos, k, v, keys_at, scale, window)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]
    mask = None
    last = int(q_pos[0]) == (k.shape[0] - 1 if k_pos is None else int(k_pos[-1]))
    first = 0 if k_pos is None else int(k_pos[0])
    if not (q.shape[0] == 1 and last and (not window or int(q_pos[0]) - first < window)):  # a last row sees everything
        if k_pos is None:
            k_pos = torch.arange(k.shape[0], device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [R, Lk]
        if window:
            mask &= q_pos[:, None] - k_pos[None, :] < window
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)  # [R, H*D]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One sequence: q [Lq, H, D], k/v [Lk, Hkv, D] -> [Lq, H*D], queries = last Lq positions."""
    q_len, k_len = q.shape[0], k.shape[0]
    if window and k_len > window:  # NOTE: attend_at runs long prompts in bands
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
        return attend_at(q, q_pos, k, v, scale, window=window)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L, D]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    elif q_len == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    else:
        mask = causal_offset_mask(q_len, k_len, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(q_len, -1)  # [Lq, H*D]


def _context(k_new, v_new, kv, layer: int, batch: AttentionBatch, i: int, window: int = 0):
    """Sequence i's K/V [L, Hkv, D] and their positions [L] (None: 0..ctx-1): the whole context,
    or with a window only the keys some row of the step can see."""
    slots = batch.read_slots[i]
    if slots is None:  # NOTE: fresh prefill: its K/V are all in hand, skip the gather.
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        return k_new[lo:hi], v_new[lo:hi], None
    k_pos = batch.key_pos[i] if batch.key_pos is not None else None
    if window:
        # NOTE: a key no row's window holds is never read: a windowed layer's cache need not hold
        # it (its page may be gone, the fill writes only what later rows reach), and the slab is
        # not zeroed: a masked key's garbage would still reach the sum (0 * NaN).
        if batch.scattered(i):
            seen = batch.seen_by_window(i, window)  # [P] bool, by position
            if k_pos is None:  # NOTE: slots then go by position
                k_pos = seen.nonzero().flatten()
                return *kv.read(layer, slots[k_pos]), k_pos
            keep = (k_pos < seen.shape[0]) & seen[k_pos.clamp(max=seen.shape[0] - 1)]  # [K]
            return *kv.read(layer, slots[keep]), k_pos[keep]
        first = batch.first_row_position(i) - window + 1
        if k_pos is None:
            keep = max(first, 0)
            return *kv.read(layer, slots[keep:]), torch.arange(keep, len(slots), device=slots.device)  # type: ignore[call-overload]
        visible = k_pos >= first
        slots, k_pos = slots[visible], k_pos[visible]
    return *kv.read(layer, slots), k_pos


def _seen_by(q_pos: torch.Tensor, window: int, ctx: int) -> torch.Tensor:
    """[ctx] bool: positions inside some row's window (q - window < p <= q), for rows at q_pos [n],
    all below ctx."""
    edges = torch.zeros(ctx + 1, dtype=torch.int64, device=q_pos.device)
    edges.index_add_(0, (q_pos - window + 1).clamp(min=0), torch.ones_like(q_pos))
    edges.index_add_(0, q_pos + 1, -torch.ones_like(q_pos))
    return edges[:ctx].cumsum(0) > 0


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv,
    layer: int,
    batch: AttentionBatch,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend per sequence.

    q [N, H, D], k_new/v_new [N, Hkv, D] -> [N, H*D]. window > 0: a row sees only the keys
    less than `window` positions behind it (a sliding-window layer)."""
    kv.write(layer, batch.write_slots, k_new, v_new)
    served = None
    if _batched_for(q, batch):
        out, pick = _batched(q, None, kv, layer, batch, scale, window)  # [R', H*D]
        if pick is None:  # NOTE: the decode step: every row was served in that one call
            return out
        served = batch.paged.served_seqs
    outs = []
    for i in range(batch.num_seqs):
        if served is not None and served[i]:
            continue
        lo, hi = batch.query_starts[i], batch.query_starts[i + 1]
        k, v, k_pos = _context(k_new, v_new, kv, layer, batch, i, window)
        if batch.scattered(i) or k_pos is not None:
            outs.append((lo, attend_at(q[lo:hi], batch.row_positions(i, q.device), k, v, scale, k_pos, window)))
        else:
            outs.append((lo, attend(q[lo:hi], k, v, scale, window)))
    if served is None:
        return outs[0][1] if len(outs) == 1 else torch.cat([o for _, o in outs], dim=0)
    full = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [N, H*D]
    full[pick] = out
    for lo, o in outs:
        full[lo : lo + o.shape[0]] = o
    return full


def paged_attention_rows(
    q: torch.Tensor,
    rows: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv,
    layer: int,
    batch: AttentionBatch,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Like paged_attention, but only the sorted batch rows `rows` [R] attend; all rows' K/V
    are written. q [R, H, D] holds those rows' queries -> [R, H*D]."""
    kv.write(layer, batch.write_slots, k_new, v_new)
    out = q.new_empty(rows.shape[0], q.shape[1] * q.shape[2])  # [R, H*D]
    starts = torch.tensor(batch.query_starts, device=rows.device)
    owner = torch.searchsorted(starts, rows, right=True) - 1  # [R] sequence of each row
    served = None
    if _batched_for(q, batch) and rows.numel():
        done, pick = _batched(q, rows, kv, layer, batch, scale, window)
        if pick is None:
            return done
        out[pick] = done
        served = batch.paged.served_seqs
    for i in owner.unique_consecutive().tolist():
        if served is not None and served[i]:
            continue
        pick = (owner == i).nonzero().flatten()
        pos = batch.row_positions(i, rows.device)[rows[pick] - batch.query_starts[i]]  # [Ri]
        k, v, k_pos = _context(k_new, v_new, kv, layer, batch, i, window)
        out[pick] = attend_at(q[pick], pos, k, v, scale, k_pos, window)
    return out


def key_mass(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    rows_per_block: int = 64,
    window: int = 0,
) -> torch.Tensor:
    """Attention each key receives: q [R, H, D] at q_pos [R] over k [Lk, Hkv, D] at k_pos [Lk]
    -> float32 [Lk], the softmax probabilities summed over rows and heads (causal by position).

    What the attention and probe selectors rank prefix rows by (seed 000, §2.4); the same
    quantity as scattered_rows_attention's key_mass. Rows go in blocks to bound the [r, H, Lk]
    score tensor."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [Lk, H, D]
    mass = torch.zeros(k.shape[0], dtype=torch.float32, device=q.device)
    for lo in range(0, q.shape[0], rows_per_block):
        qb, pb = q[lo : lo + rows_per_block].float(), q_pos[lo : lo + rows_per_block]
        scores = torch.einsum("rhd,lhd->rhl", qb, kf) * scale  # [r, H, Lk]
        visible = k_pos[None, :] <= pb[:, None]  # [r, Lk]
        if window:
            visible &= pb[:, None] - k_pos[None, :] < window
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        mass += torch.softmax(scores, dim=-1).sum(dim=(0, 1))
    return mass
