"""Soak: mixed traffic for a fixed time (streams, cut streams, chat, tokenize, bad input) while
the server's RSS is sampled; reports the growth after a warm-up and the status histogram.

  python scripts/reliability/soak.py --minutes 10 [--users 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time

import httpx

from _server import rss_mib, run, serve, stream_text, wait_idle


async def user(client: httpx.AsyncClient, rng: random.Random, until: float, statuses: collections.Counter) -> None:
    while time.monotonic() < until:
        kind = rng.choice(["complete", "stream", "cut", "chat", "tokenize", "bad", "long"])
        n = rng.randint(5, 40)
        try:
            if kind in ("stream", "cut"):
                await stream_text(
                    client,
                    {"prompt": f"Tell me about item {n}:", "max_tokens": 32, "temperature": 0.7, "seed": n},
                    cut_after=rng.randint(1, 6) if kind == "cut" else None,
                )
                statuses[f"{kind} 200"] += 1
                continue
            if kind == "complete":
                r = await client.post("/v1/completions", json={"prompt": f"Count to {n}:", "max_tokens": 16})
            elif kind == "long":
                r = await client.post(
                    "/v1/completions", json={"prompt": "The mill turned. " * (40 * n), "max_tokens": 4}
                )
            elif kind == "chat":
                r = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": f"Name {n % 5 + 1} colours."}], "max_tokens": 16},
                )
            elif kind == "tokenize":
                r = await client.post("/tokenize", json={"prompt": "word " * (n * 50)})
            else:
                r = await client.post(
                    "/v1/completions",
                    json=rng.choice(
                        [
                            {"prompt": "hi", "temperature": -1},
                            {"prompt": ""},
                            {"messages": []},
                            {"prompt": "hi", "n": 3},
                        ]
                    ),
                )
            statuses[f"{kind} {r.status_code}"] += 1
        except httpx.HTTPError as e:
            statuses[f"{kind} {type(e).__name__}"] += 1


async def traffic(url: str, users: int, seconds: float, seed: int) -> collections.Counter:
    statuses: collections.Counter = collections.Counter()
    until = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(user(client, random.Random(seed + i), until, statuses) for i in range(users)))
    return statuses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--warmup-minutes", type=float, default=1)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with serve("--threads", str(args.threads)) as srv:
        samples: list[tuple[float, float]] = []

        async def sampled() -> collections.Counter:
            t0 = time.monotonic()
            task = asyncio.create_task(traffic(srv.url, args.users, args.minutes * 60, args.seed))
            while not task.done():
                samples.append((time.monotonic() - t0, rss_mib(srv.proc.pid)))
                await asyncio.wait([task], timeout=10)
            samples.append((time.monotonic() - t0, rss_mib(srv.proc.pid)))
            return task.result()

        statuses = run(sampled())
        idle = wait_idle(srv.url, 10)
    warm = [rss for t, rss in samples if t >= args.warmup_minutes * 60]
    first, last, peak = warm[0], warm[-1], max(warm)
    total = sum(statuses.values())
    fivexx = sum(c for k, c in statuses.items() if k.split()[-1].startswith("5"))
    errors = sum(c for k, c in statuses.items() if not k.split()[-1].isdigit())
    print(
        f"soak: {args.minutes:g} min, {args.users} users, {total} requests, 5xx={fivexx}, client errors={errors}; "
        f"RSS after {args.warmup_minutes:g} min warm-up {first:.0f} MiB -> end {last:.0f} MiB "
        f"(growth {last - first:+.1f} MiB, peak {peak:.0f}); idle after: {idle is not None}"
    )
    print("soak: statuses " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))
    per_minute = {}
    for t, rss in samples:
        per_minute.setdefault(int(t // 60), rss)
    print("soak: RSS at each minute (MiB) " + " ".join(f"{m}:{rss:.0f}" for m, rss in sorted(per_minute.items())))
    ok = fivexx == 0 and errors == 0 and idle is not None
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
