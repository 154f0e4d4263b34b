"""The two tensor-parallel choices issue 30 asks to measure, each way, on real ranks over gloo:

(a) the embedding and LM head replicated (every rank holds all V rows and computes every logit)
    or vocab-parallel (each rank holds V/n rows: its embedding rows looked up where the id is
    its own and the rows all-reduced; its logits all-gathered, as every rank samples);
(b) RidgeFill's maps replicated (each rank predicts x̂ [F, d] whole) or row-sharded (each rank
    predicts d/n of the columns and the parts are all-gathered).

    python benchmarks/tensor_parallel_parts.py --ranks 2 --threads 1 --rounds 30

Each rank runs with `--threads` threads; both arms run on the same ranks, in turns, after a
barrier per repetition, and the cell is the median of rank 0's times (a collective waits for the
slower rank, so rank 0's time is the step's). The weights are the real models' as the engine holds
them (weights = auto: packed Q8_0 / Q4_1 with the compiled extension): Gemma 3 270M's 262144 x 640
tied table and its shipped maps (float32, as resident maps run), SmolLM2-135M's 49152 x 576; a
vocab-parallel rank keeps its rows of the same packed table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ridgefill_runtime.ops.packed_linear import linear, weight_rows, weight_slice

MODELS = {"gemma3-270m": "gemma3-270m", "smollm2-135m": None}  # label -> EngineConfig.model


def timed(fn, rounds: int) -> float:
    """Median ms of fn over `rounds`, every rank starting together."""
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def real_weights(model: str | None):
    """(embedding table, LM head, hidden size) of the model as the engine builds it on one rank."""
    from ridgefill_runtime.config import EngineConfig
    from ridgefill_runtime.llm import _wants_packed
    from ridgefill_runtime.loader.load import load_checkpoint
    from ridgefill_runtime.models.registry import family

    ckpt = load_checkpoint(model, packed=_wants_packed(EngineConfig(model=model)))
    built = family(ckpt.config.architecture).build_model(ckpt.config, ckpt.tensors, dtype=torch.float32, device="cpu")
    return built.weights.embed, built.weights.lm_head, ckpt.config.hidden_size


def head_arms(head, d: int, rows: int, rank: int, n: int):
    """(replicated, vocab-parallel) LM head over `rows` final hidden rows -> logits [rows, V] on every rank."""
    vocab = head.shape[0]
    mine = weight_slice(head, rank * vocab // n, (rank + 1) * vocab // n)
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(0))
    parts = [torch.empty(rows, vocab // n) for _ in range(n)]

    def replicated():
        return linear(x, head)

    def vocab_parallel():
        dist.all_gather(parts, linear(x, mine))
        return torch.cat(parts, dim=1)

    return replicated, vocab_parallel


def embed_arms(table, rows: int, rank: int, n: int):
    """(replicated, vocab-parallel) embedding of `rows` ids -> [rows, d] on every rank."""
    vocab = table.shape[0]
    lo, hi = rank * vocab // n, (rank + 1) * vocab // n
    mine = weight_slice(table, lo, hi)
    ids = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))

    def replicated():
        return weight_rows(table, ids, torch.float32)

    def vocab_parallel():
        own = (ids >= lo) & (ids < hi)
        h = weight_rows(mine, (ids - lo).clamp(0, hi - lo - 1), torch.float32) * own[:, None]  # [rows, d]
        dist.all_reduce(h)  # NOTE: zero where another rank's: the sum is each row's one lookup
        return h

    return replicated, vocab_parallel


def map_arms(a: torch.Tensor, b: torch.Tensor, rows: int, rank: int, n: int):
    """(replicated, row-sharded) map prediction x̂ = x_S A^T + b of `rows` filled rows -> [rows, d]."""
    d = a.shape[0]
    lo, hi = rank * d // n, (rank + 1) * d // n
    a_mine, b_mine = a[lo:hi].clone(), b[lo:hi].clone()
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(2))
    parts = [torch.empty(rows, d // n) for _ in range(n)]

    def replicated():
        return F.linear(x, a, b)

    def sharded():
        dist.all_gather(parts, F.linear(x, a_mine, b_mine))
        return torch.cat(parts, dim=1)

    return replicated, sharded


def turns(rep, par, rounds: int) -> tuple[float, float]:
    """Both arms twice, in turns; each arm's better median."""
    cells = [timed(rep, rounds), timed(par, rounds), timed(rep, rounds), timed(par, rounds)]
    return min(cells[0::2]), min(cells[1::2])


def nbytes(w) -> int:
    return w.nbytes() if callable(getattr(w, "nbytes", None)) else w.numel() * w.element_size()


def gemma_map():
    """The shipped Gemma 3 270M maps' first late layer, as resident maps hold it: (A [d, d], b [d])."""
    from ridgefill_runtime.fill.maps import FillMaps
    from ridgefill_runtime.fill.settings import PACKAGED_MAPS, shipped_maps

    split = PACKAGED_MAPS["gemma3-270m"][1]
    maps = FillMaps(shipped_maps(split, "gemma3-270m"), "resident", torch.float32, torch.device("cpu"))
    return maps._weights(maps.layers[0])


def worker(rank: int, n: int, port: int, threads: int, rounds: int, queue) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    results = []
    with torch.inference_mode():
        for label, model in MODELS.items():
            table, head, d = real_weights(model)
            for rows in (1, 16):
                rep, par = head_arms(head, d, rows, rank, n)
                assert torch.allclose(rep(), par(), atol=1e-3)  # the two arms compute the same logits
                results.append(("LM head", label, rows, nbytes(head), *turns(rep, par, rounds)))
            for rows in (1, 1024):
                rep, par = embed_arms(table, rows, rank, n)
                assert torch.equal(rep(), par())
                results.append(("embedding", label, rows, nbytes(table), *turns(rep, par, rounds)))
        a, b = gemma_map()
        rep, par = map_arms(a, b, 512, rank, n)
        assert torch.allclose(rep(), par(), atol=1e-4)
        results.append(("one late layer's map", "gemma3-270m", 512, nbytes(a) + nbytes(b), *turns(rep, par, rounds)))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    from ridgefill_runtime.parallel.group import free_port

    load = open("/proc/loadavg").read().split()[:3]
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [
        ctx.Process(target=worker, args=(r, args.ranks, port, args.threads, args.rounds, queue))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    results = None
    while results is None:
        try:
            results = queue.get(timeout=5)
        except Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed (its traceback is above)") from None
    for p in procs:
        p.join()
    print(f"# {args.ranks} ranks over gloo, {args.threads} thread(s) each; median of {args.rounds}, best of 2 turns")
    print(f"# load average before (1, 5, 15 min): {' '.join(load)}; cpus: {os.cpu_count()}")
    print(
        "| part | shapes of | rows | whole MiB | replicated ms | sharded ms | sharded / replicated | MiB saved per rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for part, model, rows, size, rep, par in results:
        mib = size / 2**20
        saved = mib * (1 - 1 / args.ranks)
        print(f"| {part} | {model} | {rows} | {mib:.1f} | {rep:.3f} | {par:.3f} | {par / rep:.2f} | {saved:.1f} |")


if __name__ == "__main__":
    main()
