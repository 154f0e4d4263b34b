"""Concurrency equality: N concurrent greedy streams give exactly what each gives alone, also
when a small KV pool forces preemption (recompute) and with the fill on.

  python scripts/reliability/equality.py --streams 64 [--num-blocks 64] [--fill plain] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from _server import idle_state, metric, run, serve, stream_text

SUBJECTS = ["cat", "dog", "king", "ship", "tree", "robot", "child", "river", "storm", "lamp", "train", "owl"]


def prompt(i: int, words: int) -> str:
    lead = " ".join(f"line {j}: the {SUBJECTS[(i + j) % len(SUBJECTS)]} counted {j * i % 17}." for j in range(words))
    return f"{lead}\nStory {i}: once upon a time, a {SUBJECTS[i % len(SUBJECTS)]}"


async def answers(url: str, bodies: list[dict], together: bool) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_connections=len(bodies))) as client:
        if together:
            return list(await asyncio.gather(*(stream_text(client, b) for b in bodies)))
        return [await stream_text(client, b) for b in bodies]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--words", type=int, default=2, help="filler lines before each story (fill: make prompts long)")
    p.add_argument("--num-blocks", type=int, default=None, help="a small pool forces preemption")
    p.add_argument("--fill", choices=["off", "plain"], default="off")
    p.add_argument("--fill-tail", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    extra = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    if args.fill == "plain":
        extra += ["--fill", "plain", "--fill-tail", str(args.fill_tail)]
    bodies = [
        {"prompt": prompt(i, args.words), "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
        for i in range(args.streams)
    ]
    with serve("--threads", str(args.threads), "--max-num-seqs", str(args.streams), *extra) as srv:
        alone = run(answers(srv.url, bodies, together=False))
        t0 = time.monotonic()
        together = run(answers(srv.url, bodies, together=True))
        took = time.monotonic() - t0
        text = httpx.get(srv.url + "/metrics").text
        try:
            preempted = metric(text, "ridgefill_preemptions_total")
        except KeyError:
            preempted = float("nan")
        idle = idle_state(srv.url)
    mismatches = sum(a != b for a, b in zip(alone, together))
    ok = mismatches == 0 and all(alone) and idle == (0.0, 0.0, 0.0)
    print(
        f"equality: fill={args.fill} streams={args.streams} num_blocks={args.num_blocks or 'default'} "
        f"together in {took:.1f} s; mismatches={mismatches}; preemptions={preempted:.0f}; "
        f"idle after (kv, running, waiting)={idle} -> {'PASS' if ok else 'FAIL'}"
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
