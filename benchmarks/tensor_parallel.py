"""What tensor parallelism costs and saves, against one rank, in one run.

    python benchmarks/tensor_parallel.py --model gemma3-270m --ranks 2 --threads 2 --rounds 3
    python benchmarks/tensor_parallel.py --model /models/llama --device cuda --ranks 2   # a GPU machine (NCCL)

(a) Weights per rank: the bytes each rank's model holds (packed weights as packed), built here from
    the same checkpoint for every rank of `--ranks` and for one rank. The norms are whole on every
    rank, the embedding and LM head split by token (parallel/shard.py); the table says how much of
    a rank is whole.
(b) Step time: on the CPU the same cores either way, one rank with `--threads` threads against
    `--ranks` ranks of `--threads / --ranks` threads each: a `--prompt`-token prefill (TTFT) and the
    median decode step at batch 1 and at `--batch` sequences after it. The arms take turns `--rounds`
    times; each cell is the median of its rounds.
    On the CPU a third arm runs the ranks with backend = "gloo" (TCP), the others on "auto"
    (shared-memory collectives, parallel/shm.py).
(c) Communication: on rank 0, the time inside the all-reduces (two per layer and the embedding's),
    the logits' all-gather and the step's send, as a share of the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's real-text helper
from prefill import real_text_ids  # noqa: E402


def weights_per_rank(model: str | None, ranks: int, dtype: torch.dtype, device: str) -> list[int]:
    """Bytes of each rank's weights (rank order); [one rank's] for ranks = 1."""
    from ridgefill_runtime.llm import _wants_packed
    from ridgefill_runtime.config import EngineConfig
    from ridgefill_runtime.loader.load import load_checkpoint
    from ridgefill_runtime.models.registry import family
    from ridgefill_runtime.parallel.shard import Shard, shard_checkpoint

    out = []
    for rank in range(ranks):
        ckpt = load_checkpoint(model, packed=_wants_packed(EngineConfig(model=model, device=device)))
        cfg, tensors = ckpt.config, ckpt.tensors
        if ranks > 1:
            cfg, tensors = shard_checkpoint(cfg, tensors, Shard(rank, ranks))
        built = family(cfg.architecture).build_model(cfg, tensors, dtype=dtype, device=device)
        out.append(_all_bytes(built.weights))
    return out


def _nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return w.nbytes() if callable(getattr(w, "nbytes", None)) else 0  # a PackedWeight


def _all_bytes(weights) -> int:
    """Every tensor the weights hold, once (a tied head is the embedding)."""
    from dataclasses import fields, is_dataclass

    nbytes = _nbytes
    seen: dict[int, int] = {}

    def walk(obj) -> None:
        if is_dataclass(obj) and not isinstance(obj, type) and not hasattr(obj, "nbytes"):
            for f in fields(obj):
                walk(getattr(obj, f.name))
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x)
        elif nbytes(obj):
            seen[id(obj)] = nbytes(obj)

    walk(weights)
    return sum(seen.values())


class Clock:
    """Time spent inside a function, summed (the all-reduces, the step's send)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args):
        t = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - t


def build(args, ranks: int, backend: str = "auto"):
    from ridgefill_runtime.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from ridgefill_runtime.llm import LLM

    positions = args.prompt + args.steps + 3 * args.batch + 8
    blocks = args.batch * (-(-positions // 16) + 1)
    torch.set_num_threads(max(1, args.threads // ranks))  # NOTE: the ranks it starts take the same count
    llm = LLM(
        EngineConfig(
            model=args.model,
            device=args.device,
            cache=CacheConfig(block_size=16, num_blocks=blocks, prefix_caching="off"),
            scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=2048, chunk_size=512),
            parallel=ParallelConfig(tensor_parallel_size=ranks, backend=backend),
        )
    )
    clocks = {}
    if ranks > 1:
        model, relay = llm.engine.model, llm.engine.relay
        clocks["all_reduce"] = model.sum_shards = Clock(model.sum_shards)
        clocks["all_gather"] = model.gather_vocab = Clock(model.gather_vocab)  # the logits
        clocks["send"] = relay.group.send_step = Clock(relay.group.send_step)
    return llm, clocks


def measure(llm, clocks, args, ids: list[int]) -> dict:
    """TTFT of one prompt, then decode step times at batch 1 and at args.batch."""
    from ridgefill_runtime.sequence import SamplingParams

    engine = llm.engine
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([ids], one)
    ttft = time.perf_counter() - t
    out = {"ttft_ms": 1e3 * ttft}
    for batch in (1, args.batch):
        params = SamplingParams(max_tokens=args.steps + 2 * batch + 1, temperature=0, ignore_eos=True)
        seqs = [engine.add_request(ids[: args.prompt - k], params) for k in range(batch)]
        while not all(s.output_ids for s in seqs):
            engine.step()
        for c in clocks.values():
            c.seconds = 0.0
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        out[f"b{batch}_ms"] = 1e3 * statistics.median(times)
        for name, c in clocks.items():
            out[f"b{batch}_{name}_share"] = c.seconds / sum(times)
        for s in seqs:
            engine.abort(s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, required=True, help="CPU threads in all, split among the ranks")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    per_rank = weights_per_rank(args.model, args.ranks, torch.float32, args.device)
    (whole,) = weights_per_rank(args.model, 1, torch.float32, args.device)
    print(
        f"# tensor parallelism: model {args.model or 'embedded SmolLM2-135M'}, device {args.device}, {args.threads} threads in all"
    )
    print(f"# load before the run (/proc/loadavg): {Path('/proc/loadavg').read_text().strip()}")
    print("\n## weights per rank (MiB)\n")
    print("| ranks | per rank | of one rank's | whole on every rank (norms, K/V heads copied to several ranks) |")
    print("|---|---|---|---|")
    print(f"| 1 | {whole / 2**20:.1f} | 1.00 | – |")
    replicated = (
        args.ranks * per_rank[0] - whole
    )  # NOTE: what is counted ranks times, sharded parts summing to the whole
    print(
        f"| {args.ranks} | {max(per_rank) / 2**20:.1f} | {max(per_rank) / whole:.2f} | "
        f"{replicated / (args.ranks - 1) / 2**20:.1f} MiB each |"
    )

    # arm -> (ranks, backend): on the CPU "auto" sums through shared memory (parallel/shm.py), "gloo" over TCP
    layouts = {"1 rank": (1, "auto"), f"{args.ranks} ranks": (args.ranks, "auto")}
    if args.device == "cpu":
        layouts[f"{args.ranks} ranks, gloo only"] = (args.ranks, "gloo")
    # NOTE: one process holds one group at a time, so a tensor-parallel arm is built, measured and
    # closed in each round (start-up is not timed); the one-rank arm stays built
    single = build(args, 1)
    ids = real_text_ids(single[0].tokenizer, args.prompt)
    found: dict[str, list[dict]] = {name: [] for name in layouts}
    for round_ in range(args.rounds):
        for name in sorted(layouts, reverse=bool(round_ % 2)):  # NOTE: turns, each round in the other order
            ranks = layouts[name][0]
            llm, clocks = single if ranks == 1 else build(args, *layouts[name])
            torch.set_num_threads(max(1, args.threads // ranks))
            found[name].append(measure(llm, clocks, args, ids))
            if ranks > 1:
                llm.close()
    single[0].close()

    med = {name: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for name, ms in found.items()}
    one = med["1 rank"]
    cols = ("ttft_ms", "b1_ms", f"b{args.batch}_ms")
    print(f"\n## step time ({args.rounds} rounds in turns, medians; prompt {args.prompt} tokens)\n")
    print(f"| arm | threads per rank | TTFT ms | decode B=1 ms | decode B={args.batch} ms | ratios to 1 rank |")
    print("|---|---|---|---|---|---|")
    for name, m in med.items():
        threads = max(1, args.threads // layouts[name][0])
        ratios = " / ".join(f"{m[c] / one[c]:.2f}" for c in cols)
        print(f"| {name} | {threads} | {m[cols[0]]:.1f} | {m[cols[1]]:.2f} | {m[cols[2]]:.2f} | {ratios} |")
    print("\n## communication on rank 0, share of the decode step\n")
    print("| arm | batch | all-reduces | logits' all-gather | the step's send |")
    print("|---|---|---|---|---|")
    for name, m in med.items():
        if layouts[name][0] == 1:
            continue
        for b in (1, args.batch):
            shares = [m[f"b{b}_{part}_share"] for part in ("all_reduce", "all_gather", "send")]
            print(f"| {name} | {b} | " + " | ".join(f"{x:.2f}" for x in shares) + " |")


if __name__ == "__main__":
    main()
