"""Starting a tensor-parallel engine: join (or make) the group, build each rank's shard, check that
every rank started, then rank 0 serves and the others follow its steps.

Two ways in. Under torchrun every rank runs the same command (`torchrun --nproc-per-node 2
-m server.main generate ...`); torchrun's variables place it, and ranks other than 0 follow rank 0
and exit when it stops. Without torchrun, `--tensor-parallel-size N` makes this process the first
rank of its machine (rank 0 on machine 0) and starts the machine's other ranks as processes.

Start-up is all or nothing: each rank reports whether it built its shard, and one failure ends
every rank with one line naming the rank and the cause (a size the heads cannot be split by
included). A rank that never joins ends the start after parallel.timeout_s.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
from multiprocessing.process import BaseProcess
import os
import sys
import traceback
from collections.abc import Callable

import torch

from ..config import EngineConfig
from ..errors import ParallelError, RidgefillError
from .group import Rendezvous, TensorGroup, free_port
from .relay import StepRelay, follow_steps

log = logging.getLogger("ridgefill.parallel")

# (config, group, relay) -> Engine: llm.build_local_engine, the same on every rank
Build = Callable[..., object]


def wants_parallel(config: EngineConfig) -> bool:
    return config.parallel.tensor_parallel_size > 1 or Rendezvous.from_torchrun() is not None


def start_parallel_engine(config: EngineConfig, build: Build):
    """Rank 0's engine (its runner sends each step to the others). On any other rank of a
    torchrun launch: follows rank 0's steps and exits the process when it stops."""
    parallel = config.parallel
    at = Rendezvous.from_torchrun()
    children: list[BaseProcess] = []
    if at is not None:
        if at.size != parallel.tensor_parallel_size:
            raise ParallelError(
                f"torchrun started {at.size} ranks (WORLD_SIZE) but parallel.tensor_parallel_size = "
                f"{parallel.tensor_parallel_size}; pass --tensor-parallel-size {at.size}"
            )
    else:
        at, children = _start_machine(config)
    try:
        group = TensorGroup(at, parallel, config.device, alive=_watch(children))
    except ParallelError:
        _end(children)
        raise
    engine = _build_checked(config, group, build, children)
    if group.rank != 0:  # NOTE: a torchrun rank, or the first rank of a machine other than 0
        _follow(engine, group)
        _end(children)
        sys.exit(0)
    atexit.register(engine.close)  # NOTE: the other ranks leave with this process, however it ends
    return engine


def _start_machine(config: EngineConfig) -> tuple[Rendezvous, list[BaseProcess]]:
    """This machine's first rank, after starting its others as processes."""
    p = config.parallel
    if p.nnodes > 1 and p.master_port == 0:
        raise ParallelError("parallel.nnodes > 1 needs parallel.master_port: every machine must meet at one port")
    port = p.master_port or free_port(p.master_addr)
    per_node = p.tensor_parallel_size // p.nnodes
    first = p.node_rank * per_node
    ctx = mp.get_context("spawn")  # NOTE: fork would copy this process's threads and torch state
    children: list[BaseProcess] = []
    for rank in range(first + 1, first + per_node):
        at = Rendezvous(rank, p.tensor_parallel_size, p.master_addr, port)
        child = ctx.Process(
            target=worker_main,
            args=(config, at, torch.get_num_threads()),
            name=f"ridgefill-tp-rank-{rank}",
            daemon=True,
        )
        child.start()
        children.append(child)
    return Rendezvous(first, p.tensor_parallel_size, p.master_addr, port), children


def _watch(children: list[BaseProcess]):
    """rank -> None while the process started for it runs, else its exit."""
    by_rank = {int(c.name.rsplit("-", 1)[1]): c for c in children}

    def gone(rank: int) -> str | None:
        child = by_rank.get(rank)
        if child is None or child.is_alive():
            return None
        return f"its process exited with status {child.exitcode}"

    return gone


def _build_checked(config: EngineConfig, group: TensorGroup, build: Build, children: list[BaseProcess]):
    """This rank's engine, once every rank has built its own; else ParallelError naming the first rank that failed."""
    engine, error = None, None
    try:
        engine = build(config, group, _relay(group, children) if group.rank == 0 else None)
    except Exception as e:  # noqa: BLE001 - every rank hears of it, and all stop with one line
        error = str(e) if isinstance(e, RidgefillError) else f"{type(e).__name__}: {e}"
    errors = group.gather_errors(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        group.close()
        _end(children)
        rank, cause = failed[0]
        raise ParallelError(f"tensor-parallel rank {rank} failed to start: {cause}")
    return engine


def _relay(group: TensorGroup, children: list[BaseProcess]) -> StepRelay:
    """Rank 0's relay; stopping it also waits for the ranks it started and leaves the group."""

    def stopped() -> None:
        _end(children)
        group.close()

    return StepRelay(group, _watch(children), on_stop=stopped)


def _follow(engine, group: TensorGroup) -> None:
    try:
        follow_steps(engine.runner, engine.caches, group)
    finally:
        group.close()


def _end(children: list[BaseProcess], wait_s: float = 10.0) -> None:
    """Wait for the machine's other ranks to leave (they have been told to stop), then end any left."""
    for child in children:
        child.join(wait_s)
        if child.is_alive():
            child.kill()
            child.join()


def worker_main(config: EngineConfig, at: Rendezvous, threads: int) -> None:
    """A rank this machine's first rank started: build the shard, follow the steps, exit.
    NOTE: any failure prints one line naming the rank, and the process exits 1."""
    from ..llm import build_local_engine

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parent = os.getppid()
    try:
        group = TensorGroup(at, config.parallel, config.device)
        engine = _build_checked(config, group, build_local_engine, [])
    except ParallelError:
        sys.exit(1)  # NOTE: the first rank, which started this one, says why in its own one line
    try:
        _follow(engine, group)
    except BaseException as e:  # noqa: BLE001 - one line, whatever it was
        if os.getppid() == parent:
            sys.exit(1)  # NOTE: the first rank lives: it names the rank it lost in its own one line
        print(
            f"ridgefill: tensor-parallel rank {at.rank}: the rank that started it is gone ({type(e).__name__})",
            file=sys.stderr,
            flush=True,
        )
        log.debug("%s", traceback.format_exc())
        sys.exit(1)
