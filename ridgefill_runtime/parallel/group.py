"""The tensor-parallel group over torch.distributed: who this process is, the model's all-reduce,
and the channel rank 0 sends each step on.

Two process groups: the default one (gloo on the CPU, NCCL on CUDA, which is RCCL on ROCm) carries
the model's all-reduces under `parallel.timeout_s`, so a rank that died or hangs mid-step ends the
step with an error naming the cause rather than a hang. The step channel is a gloo group with no
practical timeout: a worker waits there for as long as the server has nothing to do. A worker that
dies closes its sockets, which rank 0's next collective sees at once.

With backend = "auto" on the CPU, ranks that share a machine sum and gather through one shared
file instead (shm.py): gloo's loopback TCP costs about a millisecond a collective.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import ParallelConfig
from ..errors import ParallelError
from .shm import SharedExchange, open_exchange, shared_memory_usable

log = logging.getLogger("ridgefill.parallel")
Alive = Callable[[int], "str | None"]  # rank -> None while it runs, else why it ended

# How long a worker waits for rank 0's next step: the server may idle for days.
STEP_WAIT = timedelta(days=365)


@dataclass(frozen=True)
class Rendezvous:
    """Where and as what this process joins: torchrun's environment, or what rank 0 chose for
    the workers it starts."""

    rank: int
    size: int
    addr: str
    port: int
    torchrun: bool = False  # torchrun's agent holds the store at addr:port (else rank 0 makes it)

    @staticmethod
    def from_torchrun() -> Rendezvous | None:
        """torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, set by torchrun or by
        hand), or None outside it."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return Rendezvous(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", "29500")),
            torchrun=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )


def free_port(addr: str) -> int:
    """A port nothing listens on now (rank 0 binds it again at once; a race is reported as a start failure)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def backend_for(parallel: ParallelConfig, device: str) -> str:
    if parallel.backend != "auto":
        return parallel.backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


class TensorGroup:
    """This process's place in the group, once joined."""

    def __init__(self, at: Rendezvous, parallel: ParallelConfig, device: str, alive: Alive | None = None):
        """`alive`: rank 0's check on the ranks it started (rank -> None, or why it is gone), asked
        while it waits for them, so that one that died starting ends the wait at once."""
        self.rank, self.size = at.rank, at.size
        self.timeout_s = parallel.timeout_s
        backend = backend_for(parallel, device)
        if backend == "nccl" and torch.device(device).type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", at.rank % max(1, torch.cuda.device_count()))))
        try:
            _join(at, backend, parallel.timeout_s, alive)
        except (RuntimeError, ValueError, OSError) as e:  # DistStoreError is a RuntimeError
            raise ParallelError(
                f"tensor-parallel rank {at.rank}: could not join the group of {at.size} at {at.addr}:{at.port} "
                f"({type(e).__name__}: {_first_line(e)})"
            ) from e
        self.steps = dist.new_group(backend="gloo", timeout=STEP_WAIT)
        self.shared: SharedExchange | None = None
        if parallel.backend == "auto" and backend == "gloo" and shared_memory_usable():
            self.shared = open_exchange(at.rank, at.size, parallel.timeout_s, self._broadcast, self._all_ok)
        if at.rank == 0:
            how = "shared memory" if self.shared is not None else backend
            log.info("tensor parallelism: %d ranks, collectives through %s", at.size, how)

    def sum_shards(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum of every rank's partial x (the model's o / down products, attention mass)."""
        if self.shared is not None and self.shared.fits(x):
            return self.shared.all_reduce(x)
        dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's x [R, widths[rank]] joined along the columns, [R, Σ widths], on every rank
        (a vocab-parallel head's logits). NOTE: padded to the widest part, as an all-gather moves
        equal parts."""
        wide = max(widths)
        padded = torch.nn.functional.pad(x, (0, wide - x.shape[1]))  # [R, wide]
        if self.shared is not None and self.shared.fits(padded):
            parts = self.shared.all_gather(padded)
        else:
            parts = [x.new_empty(x.shape[0], wide) for _ in widths]
            dist.all_gather(parts, padded)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

    def send_step(self, message) -> None:
        """Rank 0: one step's message to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.steps)

    def next_step(self):
        """Another rank: wait for rank 0's next message."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.steps)
        return box[0]

    def gather_errors(self, error: str | None) -> list[str | None]:
        """Every rank's start-up error (None: it started), in rank order, on every rank."""
        found: list[str | None] = [None] * self.size
        dist.all_gather_object(found, error, group=self.steps)
        return found

    def _broadcast(self, value):
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.steps)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        found = [None] * self.size
        dist.all_gather_object(found, ok, group=self.steps)
        return all(found)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(at: Rendezvous, backend: str, timeout_s: float, alive: Alive | None) -> None:
    timeout = timedelta(seconds=timeout_s)
    if at.torchrun:  # NOTE: its agent holds the store, and its own start-up waited for every rank
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    store = dist.TCPStore(at.addr, at.port, at.size, at.rank == 0, timeout, wait_for_workers=False)
    if at.rank == 0:
        _wait_for_ranks(store, at.size, timeout_s, alive)
    else:
        store.set(f"ridgefill/joined/{at.rank}", "1")
    dist.init_process_group(backend, store=store, rank=at.rank, world_size=at.size, timeout=timeout)


def _wait_for_ranks(store, size: int, timeout_s: float, alive: Alive | None) -> None:
    """Rank 0: until every rank has said it is here; ParallelError naming one that died or never came."""
    deadline = time.monotonic() + timeout_s
    for rank in range(1, size):
        while not store.check([f"ridgefill/joined/{rank}"]):  # NOTE: it may still be importing torch
            gone = alive(rank) if alive is not None else None
            if gone is not None:
                raise ParallelError(f"tensor-parallel rank {rank} failed to start: {gone} before joining")
            if time.monotonic() > deadline:
                raise ParallelError(
                    f"tensor-parallel rank {rank} did not join within {timeout_s:g} s (parallel.timeout_s)"
                )
            time.sleep(0.05)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
