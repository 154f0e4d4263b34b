"""Decode steps replayed from captured CUDA graphs.

A decode step is one row per sequence. On a GPU its ~30 layers launch a few hundred small
kernels, and at small batches the launches cost more than the work; a graph replays them all with
one launch. A graph is a fixed sequence of kernels over fixed buffers, so:

- one graph per batch size in `sizes`; a step of B sequences replays the smallest size >= B, the
  rows past B being padding;
- every input the forward reads lives in a static buffer, copied in before each replay: tokens,
  positions, write slots, block tables (`max_blocks` wide), context lengths, and the batched
  kernel's row owners (AttentionBatch.paged_given): nothing is built from host lists inside;
- a padding row is a sequence of one token at position 0 whose single block is the pool's scratch
  slot (KVPool.scratch_slot): it writes and reads there and nowhere else. Padding is reset before
  every replay, as a larger step's real rows would otherwise be left behind in it.

The forward itself is the model's ordinary one (run_model), so a graph computes what an eager
step computes. `capture` turns a forward into a replay; cuda_capture is the real one, and the
tests pass `eager` to run the same static-buffer path on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .layers.attention import AttentionBatch, PagedRows
from .models.forward import ForwardBatch, run_model
from .step_layout import SeqLayout, attention_batch

log = logging.getLogger("ridgefill.engine")

Forward = Callable[[], torch.Tensor]  # a step over the static buffers -> logits [size, V]
Capture = Callable[[Forward], Forward]

# NOTE: vLLM's spacing: every small size, then steps of 8 and 16; a step pads to the next one up
_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: the fixed ladder up to max_num_seqs, and max_num_seqs itself."""
    return tuple(sorted({s for s in _SIZES if s < max_num_seqs} | {max_num_seqs}))


def eager(forward: Forward) -> Forward:
    """No graph: every replay runs the forward over the static buffers (the CPU tests' capture)."""
    return forward


def cuda_capture(pool=None) -> Capture:
    """Capture into CUDA graphs sharing one memory pool (the largest size is captured first, so the
    smaller ones fit in its memory)."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(forward: Forward) -> Forward:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()  # NOTE: warm-up outside the graph: cuBLAS workspaces and lazy state come first
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay

    return capture


class DecodeGraphs:
    def __init__(self, model, caches, max_blocks: int, sizes: tuple[int, ...], capture: Capture):
        """`caches`: the runner's ModelCaches (its pool needs a scratch slot); `max_blocks`: the
        widest block table a graphed step may carry (max_model_len / block_size, rounded up)."""
        kv = caches.kv
        if getattr(kv, "scratch_slot", None) is None:
            raise ValueError("decode graphs need a K/V pool with a scratch slot (no paged-apart window layout)")
        if not sizes or min(sizes) < 1:
            raise ValueError(f"decode graph sizes must be positive, got {sizes}")
        self.model, self.caches = model, caches
        self.sizes = tuple(sorted(set(sizes)))
        self.largest = self.sizes[-1]
        self.max_blocks = max_blocks
        self.block_size = caches.block_size
        self._pad_slot = kv.scratch_slot
        self._pad_block = kv.scratch_slot // self.block_size
        top, dev = self.largest, model.device
        self.ids = torch.zeros(top, dtype=torch.int64, device=dev)  # [Bmax]
        self.positions = torch.zeros(top, dtype=torch.int64, device=dev)  # [Bmax]
        self.slots = torch.full((top,), self._pad_slot, dtype=torch.int64, device=dev)  # [Bmax]
        self.tables = torch.full((top, max_blocks), self._pad_block, dtype=torch.int32, device=dev)  # [Bmax, W]
        self.context_lens = torch.ones(top, dtype=torch.int32, device=dev)  # [Bmax]
        self._owner = torch.arange(top, dtype=torch.int32, device=dev)  # [Bmax]: row i is sequence i
        self._served = torch.ones(top, dtype=torch.bool, device=dev)
        self._replays = {size: capture(self._forward_of(size)) for size in reversed(self.sizes)}

    def fits(self, num_seqs: int, widest_table: int) -> bool:
        return num_seqs <= self.largest and widest_table <= self.max_blocks

    def run(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """A decode step's rows ids/positions [B] (one per sequence, in order) laid out by `batch`
        -> logits [B, V], replayed at the smallest captured size >= B."""
        b = ids.shape[0]
        size = next(s for s in self.sizes if s >= b)
        tables = batch.block_tables  # [B, w] int32
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(batch.write_slots)
        self.tables[:b, : tables.shape[1]].copy_(tables)
        self.context_lens[:b].copy_(positions + 1)
        self._pad(b, size)
        # NOTE: a copy: the graph's output buffer is overwritten by the next replay
        return self._replays[size]()[:b].clone()

    def _pad(self, lo: int, hi: int) -> None:
        """Rows lo..hi-1 become padding (one token at position 0 in the scratch slot)."""
        self.ids[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.slots[lo:hi] = self._pad_slot
        self.tables[lo:hi, 0] = self._pad_block
        self.context_lens[lo:hi] = 1

    def _forward_of(self, size: int) -> Forward:
        """The model's forward over the first `size` rows of the static buffers."""
        paged = PagedRows(
            owner=self._owner[:size],
            pos=self.positions[:size],
            served=self._served[:size],
            served_seqs=(True,) * size,
            all_served=True,
            context_lens=self.context_lens[:size],
        )
        # NOTE: the sequences' host-side layout is a placeholder of the right length (one row, a
        # context of 1, no cache read): with every row served by the batched kernel (paged_given),
        # no layer reads it
        batch = attention_batch(
            [SeqLayout(rows=1, context_len=1)] * size,
            self.slots[:size],
            block_size=self.block_size,
            block_tables=self.tables[:size],
            paged_given=paged,
        )
        step = ForwardBatch(self.ids[:size], self.positions[:size], batch, self.caches)

        def forward() -> torch.Tensor:
            return run_model(self.model, step).logits  # [size, V]

        return forward


def wants_decode_graphs(config) -> bool:
    """The engine's settings ask for decode graphs (its K/V pool then keeps a scratch slot)."""
    return config.cuda_graphs and torch.device(config.device).type == "cuda"


def engine_decode_graphs(model, caches, config, max_model_len: int) -> DecodeGraphs | None:
    """The engine's graphs: on a CUDA device with `cuda_graphs` on, for a model whose decode is
    K/V attention alone. NOTE: recurrent (hybrid) and looped models decode eagerly for now: their
    state updates have not been run under capture."""
    if not wants_decode_graphs(config) or model.device.type != "cuda":
        return None
    looped = getattr(model.config, "looped", None) is not None
    if caches.spec.recurrent_layers or looped or caches.kv.scratch_slot is None:
        return None
    max_blocks = -(-max_model_len // caches.block_size)
    try:
        return DecodeGraphs(model, caches, max_blocks, capture_sizes(config.scheduler.max_num_seqs), cuda_capture())
    except RuntimeError as e:
        # NOTE: a forward that cannot be captured (an op that syncs, a kernel without graph support) costs
        # speed, not the server: decode runs eagerly, and the warning says why
        log.warning("decode CUDA graphs could not be captured, decoding eagerly (--enforce-eager hides this): %s", e)
        return None
