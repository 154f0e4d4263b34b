"""Disconnect storm: many streams cut at random points; afterwards the KV pool is idle, no
sequence is left, and a reference greedy answer is unchanged.

  python scripts/reliability/storm.py --streams 200 [--fill plain] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from _server import run, serve, stream_text, wait_idle

REFERENCE = {"prompt": "The three primary colours are", "max_tokens": 24, "temperature": 0}


def long_prompt(i: int, words: int) -> str:
    return f"Report {i}. " + " ".join(f"item{j % 97} weighs {j % 13} kg;" for j in range(words))


async def storm(url: str, streams: int, words: int, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    cut = completed = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=streams)) as client:

        async def one(i: int) -> None:
            nonlocal cut, completed
            await asyncio.sleep(rng.random() * 2)  # arrivals spread over two seconds
            body = {
                "prompt": long_prompt(i, rng.randint(5, words)),
                "max_tokens": rng.randint(4, 64),
                "temperature": rng.choice([0, 0.8]),
                "ignore_eos": True,
            }
            out = await stream_text(client, body, cut_after=rng.randint(0, 8) or None)
            if out is None:
                cut += 1
            else:
                completed += 1

        await asyncio.gather(*(one(i) for i in range(streams)))
    return cut, completed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--words", type=int, default=60, help="most filler words per prompt (fill: make it long)")
    p.add_argument("--fill", choices=["off", "plain"], default="off")
    p.add_argument("--fill-tail", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    extra = ["--fill", args.fill, "--fill-tail", str(args.fill_tail)] if args.fill == "plain" else []
    # NOTE: every stream is admitted (the queue holds them all): the storm is about cuts, not 503s.
    with serve("--threads", str(args.threads), "--max-queued-requests", str(args.streams), *extra) as srv:
        before = run(stream_text(httpx.AsyncClient(base_url=srv.url, timeout=120), REFERENCE))
        t0 = time.monotonic()
        cut, completed = run(storm(srv.url, args.streams, args.words, args.seed))
        took = time.monotonic() - t0
        idle_after = wait_idle(srv.url, 30)
        after = run(stream_text(httpx.AsyncClient(base_url=srv.url, timeout=120), REFERENCE))
    ok = idle_after is not None and idle_after <= 3 and after == before
    print(
        f"storm: fill={args.fill} streams={args.streams} cut={cut} completed={completed} in {took:.1f} s; "
        f"KV pool and running/waiting back to 0 in "
        f"{'never (30 s)' if idle_after is None else f'{idle_after:.2f} s'}; "
        f"reference answer unchanged: {after == before} -> {'PASS' if ok else 'FAIL'}"
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
