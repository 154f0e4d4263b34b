"""All-reduce and all-gather through shared memory, for CPU ranks on one machine.

gloo's all-reduce goes through TCP on loopback: about a millisecond each on this 2-core VM, 61% of
a Gemma 3 270M decode step at two ranks (benchmarks/tensor_parallel_gemma3-270m.txt). Ranks on one
machine can instead meet in one shared file in /dev/shm: each writes its part into its own slot,
says so with a counter, waits for every other counter, then reads all slots. vLLM's CPU backend
does the same in C++; here it is numpy over a torch-mapped file.

Every rank adds the slots in rank order, so every rank gets the same bits (as gloo's sum gives).

Ordering: x86 keeps stores in order, and the lock round trip between writing a slot and raising
the counter is a full fence, so a rank that sees the counter sees the data. Other CPUs use gloo.

A rank that dies stops raising its counter: waiters check the other ranks' processes every
POLL_S and give up after `timeout_s`, with a RuntimeError the engine turns into the group's loss.
"""

from __future__ import annotations

import os
import platform
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch

SLOT_BYTES = 16 << 20  # per rank; larger tensors go through gloo
POLL_S = 0.1  # how often a waiting rank looks for dead peers
_HEADER = 4096  # counters [2, n] int64 and pids [n] int64, then the slots (page aligned)


def shared_memory_usable() -> bool:
    """Where the store ordering argument holds and /dev/shm exists."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def new_path() -> str:
    return f"/dev/shm/ridgefill-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class SharedExchange:
    """One rank's end of the shared file at `path` (rank 0 creates it before the others open it)."""

    def __init__(self, path: str, rank: int, size: int, timeout_s: float, create: bool):
        if size * 3 * 8 > _HEADER:
            raise ValueError(f"{size} ranks do not fit the shared header")
        total = _HEADER + size * SLOT_BYTES
        if create:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)  # NOTE: reserve it now: a full tmpfs would SIGBUS on a write
            finally:
                os.close(fd)
        elif os.path.getsize(path) != total:  # NOTE: raises when absent: another machine's rank 0 made it
            raise OSError(f"{path} is not this group's shared file")
        self.bytes = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)  # [total]
        header = self.bytes[:_HEADER].view(torch.int64).numpy()
        self.arrived, self.done = header[:size], header[size : 2 * size]  # per rank: the last generation
        self.pids = header[2 * size : 3 * size]
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.generation = 0
        self._fence = threading.Lock()
        self.pids[rank] = os.getpid()

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank the same bits)."""
        parts = self._exchange(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        self._release()
        return x.copy_(total.view_as(x))

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (all the same shape), in rank order, as copies."""
        parts = [p.clone().view_as(x) for p in self._exchange(x)]
        self._release()
        return parts

    def _slot(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = _HEADER + rank * SLOT_BYTES
        return self.bytes[start : start + x.numel() * x.element_size()].view(x.dtype)  # [numel]

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.generation += 1
        g = self.generation
        self._wait(self.done, g - 1)  # NOTE: every rank has read the last exchange's slots
        self._slot(self.rank, x).copy_(x.reshape(-1))
        with self._fence:  # NOTE: a locked instruction: the slot's stores are visible before the counter's
            self.arrived[self.rank] = g
        self._wait(self.arrived, g)
        return [self._slot(r, x) for r in range(self.size)]

    def _release(self) -> None:
        self.done[self.rank] = self.generation

    def _wait(self, counters: np.ndarray, g: int) -> None:
        if counters.min() >= g:
            return
        start = time.monotonic()
        checked = start
        while counters.min() < g:
            os.sched_yield()  # NOTE: lets a rank sharing this core run
            now = time.monotonic()
            if now - checked > POLL_S:
                checked = now
                self._check_peers(counters, g, now - start)

    def _check_peers(self, counters: np.ndarray, g: int, waited: float) -> None:
        for r in range(self.size):
            if counters[r] < g and _gone(int(self.pids[r])):
                raise RuntimeError(f"shared-memory exchange: rank {r}'s process (pid {int(self.pids[r])}) ended")
        if waited > self.timeout_s:
            late = [r for r in range(self.size) if counters[r] < g]
            raise RuntimeError(f"shared-memory exchange: ranks {late} did not arrive within {self.timeout_s:g} s")

    def close(self) -> None:
        self.bytes = torch.empty(0, dtype=torch.uint8)


def _gone(pid: int) -> bool:
    """The process has exited (or is a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def open_exchange(
    rank: int,
    size: int,
    timeout_s: float,
    broadcast: Callable[[str | None], str | None],
    all_ok: Callable[[bool], bool],
) -> SharedExchange | None:
    """Every rank's end of one new shared file, or None on every rank when any rank cannot open it
    (they then use gloo). `broadcast` hands rank 0's value to every rank; `all_ok` is True on every
    rank when every rank passed True. The file is unlinked once all have opened it: the mappings
    stay, and nothing is left in /dev/shm whatever happens later."""
    path, exchange = None, None
    if rank == 0:
        try:
            path = new_path()
            exchange = SharedExchange(path, rank, size, timeout_s, create=True)
        except OSError:
            path = None  # NOTE: e.g. a /dev/shm too small for the slots: gloo serves
    path = broadcast(path)
    if path is not None and exchange is None:
        try:
            exchange = SharedExchange(path, rank, size, timeout_s, create=False)
        except (OSError, RuntimeError):
            exchange = None
    ok = all_ok(exchange is not None)
    if rank == 0 and path is not None:
        os.unlink(path)
    if not ok and exchange is not None:
        exchange.close()
    return exchange if ok else None
