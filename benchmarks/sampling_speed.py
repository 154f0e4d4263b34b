"""Top-p filtering time per sampled token over a large vocabulary: ridgefill's filter_logits (the
nucleus looked for among the top NUCLEUS_CANDIDATES tokens, the whole vocabulary sorted only where
their mass falls short) against the full sort it replaced, on the same logits, in one run.

    python benchmarks/sampling_speed.py --threads 2 --vocab 262144

Two kinds of logits: "peaked" (Gaussian noise with 50 tokens raised well above it, so that a few
tokens hold almost all the mass, as a language model's next-token distribution usually does) and
"flat" (Gaussian noise only: the candidates fall short and both sides sort everything). Each
timing is the median of --reps calls. The kept sets can differ only in a token whose mass before
it lies within float32 rounding of top_p (the candidates' probabilities are normalized over the
vocabulary in its own order, the full sort's in sorted order): the table counts them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: paged_attention_cpu.py's median timer
from paged_attention_cpu import timed  # noqa: E402
from ridgefill_runtime.sampling import NUCLEUS_CANDIDATES, filter_logits  # noqa: E402


def full_sort_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The previous top-p filter: sort the whole vocabulary."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    drop_sorted[0] = False
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=262144, help="Gemma 3's vocabulary")
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(args.vocab, generator=gen) * 2
    peaked = noise.clone()
    peaked[torch.randint(0, args.vocab, (50,), generator=gen)] += torch.rand(50, generator=gen) * 12 + 8
    print(f"threads={args.threads} vocab={args.vocab} top_p={args.top_p} candidates={NUCLEUS_CANDIDATES}")
    print("| logits | top-1024 mass | kept (full sort) | kept differently | full sort ms | ridgefill ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name, logits in (("peaked", peaked), ("flat", noise)):
        ours = torch.isfinite(filter_logits(logits, 0, args.top_p))
        theirs = torch.isfinite(full_sort_filter(logits, args.top_p))
        differ = int((ours != theirs).sum())
        mass = float(logits.softmax(-1).topk(NUCLEUS_CANDIDATES).values.sum())
        full = timed(lambda: full_sort_filter(logits, args.top_p), args.reps) * 1e3
        new = timed(lambda: filter_logits(logits, 0, args.top_p), args.reps) * 1e3
        print(f"| {name} | {mass:.4f} | {int(theirs.sum())} | {differ} | {full:.2f} | {new:.2f} | {full / new:.1f}x |")


if __name__ == "__main__":
    main()
