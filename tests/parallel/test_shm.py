"""The shared-memory collectives (parallel/shm.py) on real spawned ranks: sums against a float64
sum of every rank's input, the same bits on every rank (as gloo gives), gathers in rank order,
many exchanges of changing shapes and dtypes through the same slots, and a rank that dies named
by the others within a second, not at the timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ridgefill_runtime.parallel.group import free_port
from ridgefill_runtime.parallel.shm import open_exchange, shared_memory_usable

pytestmark = pytest.mark.skipif(not shared_memory_usable(), reason="shared-memory collectives are x86 Linux only")

SHAPES = [(1, 640), (16, 640), (3, 7), (512, 96), (2, 131072)]


def _inputs(rank: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(SHAPES[i % len(SHAPES)], generator=g, dtype=torch.float64).to(dtype)


def _broadcast(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(ok: bool) -> bool:
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, ok)
    return all(found)


def _worker(rank: int, size: int, port: int, die: int | None, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    ex = open_exchange(rank, size, 30.0, _broadcast, _all_ok)
    assert ex is not None
    if die is not None:
        if rank == die:
            ex.all_reduce(torch.ones(4))  # one exchange, then gone without a word
            import os

            os._exit(3)
        ex.all_reduce(torch.ones(4))
        start = time.monotonic()
        try:
            ex.all_reduce(torch.ones(4))
            out.put((rank, "no error", 0.0))
        except RuntimeError as e:
            out.put((rank, str(e), time.monotonic() - start))
        return
    sums, gathers = [], []
    for i in range(30):
        dtype = torch.float64 if i % 3 == 2 else torch.float32
        sums.append(ex.all_reduce(_inputs(rank, i, dtype)))
        gathers.append(ex.all_gather(_inputs(rank, i, dtype)))
    # NOTE: numpy arrays travel by value (a tensor would be shared through this process, about to exit)
    out.put((rank, [t.numpy() for t in sums], [[t.numpy() for t in g] for g in gathers]))
    dist.barrier()


def _run(size: int, die: int | None = None) -> list:
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=_worker, args=(r, size, port, die, out)) for r in range(size)]
    for p in procs:
        p.start()
    want = size - (die is not None)
    results = [out.get(timeout=120) for _ in range(want)]
    for p in procs:
        p.join(60)
    return sorted(results, key=lambda r: r[0])


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_equal_the_reference_on_every_rank(size):
    results = _run(size)
    for i in range(30):
        dtype = torch.float64 if i % 3 == 2 else torch.float32
        want = sum(_inputs(r, i, dtype).double() for r in range(size))
        first = torch.from_numpy(results[0][1][i])
        assert first.dtype == dtype and first.shape == want.shape
        assert torch.allclose(first.double(), want, rtol=1e-6, atol=1e-6)
        for rank, sums, gathers in results:
            assert torch.equal(torch.from_numpy(sums[i]), first), (rank, i)  # the same bits everywhere
            for r in range(size):
                assert torch.equal(torch.from_numpy(gathers[i][r]), _inputs(r, i, dtype))


def test_a_rank_that_dies_is_named_at_once_not_at_the_timeout():
    results = _run(3, die=2)
    assert [r for r, _, _ in results] == [0, 1]
    for _, message, took in results:
        assert "rank 2's process" in message and "ended" in message
        assert took < 2.0  # the timeout is 30 s


def test_an_engine_sums_through_shared_memory_and_equals_gloo_alone(tmp_path):
    """backend = "auto" on this CPU puts the group's collectives in shared memory; "gloo" keeps TCP.
    Both give one rank's outputs (tests/parallel/test_tensor_parallel.py runs every family on auto)."""
    from ridgefill_runtime.config import CacheConfig, EngineConfig, ParallelConfig
    from ridgefill_runtime.llm import LLM
    from ridgefill_runtime.sequence import SamplingParams
    from tiny_models import build_tiny

    build_tiny("llama_tp_mha", tmp_path)
    ids = torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    found = {}
    for backend in ("auto", "gloo"):
        llm = LLM(
            EngineConfig(
                model=str(tmp_path),
                cache=CacheConfig(num_blocks=32),
                parallel=ParallelConfig(tensor_parallel_size=2, backend=backend),
            )
        )
        try:
            shared = llm.engine.relay.group.shared is not None
            scored = torch.tensor(llm.score(ids)["target_logprobs"])
            tokens = llm.generate([ids[:20]], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
            found[backend] = (shared, scored, tokens)
        finally:
            llm.close()
    assert found["auto"][0] and not found["gloo"][0]
    assert (found["auto"][1] - found["gloo"][1]).abs().max() < 1e-5
    assert found["auto"][2] == found["gloo"][2]
