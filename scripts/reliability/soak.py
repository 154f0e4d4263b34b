"""Soak: mixed traffic for a fixed time (streams, cut streams, chat, tokenize, bad input) while
the server's RSS and its touched K/V pool bytes are sampled; reports, after a warm-up, the slope
of RSS minus the touched pool (what a leak would grow: the pool's pages join the RSS as traffic
first reaches them, which is no leak) with its standard error, and the status histogram.

  python scripts/reliability/soak.py --minutes 30 [--users 4] [--threads 2] [--out soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import time
from pathlib import Path

import httpx

from _server import metric, rss_mib, run, serve, stream_text, wait_idle


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


def pool_touched_mib(url: str) -> float:
    """The K/V pool bytes the server has ever written (its slabs are allocated untouched, so they
    join the RSS block by block as traffic first reaches them), in MiB."""
    return metric(httpx.get(url + "/metrics", timeout=10).text, "ridgefill_kv_cache_touched_bytes") / 2**20


def slope_per_hour(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares slope of (seconds, MiB) in MiB per hour, and its standard error."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((t - mt) ** 2 for t, _ in points)
    slope = sum((t - mt) * (y - my) for t, y in points) / sxx
    resid = sum((y - my - slope * (t - mt)) ** 2 for t, y in points)
    stderr = (resid / (n - 2) / sxx) ** 0.5 if n > 2 else float("nan")
    return slope * 3600, stderr * 3600


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--warmup-minutes", type=float, default=1)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the samples and summary here (JSON)")
    args = p.parse_args()
    with serve("--threads", str(args.threads)) as srv:
        samples: list[tuple[float, float, float]] = []  # (seconds, RSS MiB, touched pool MiB)
        loads: list[float] = []  # 1-minute load average at each sample: the soak's own load plus anything else

        async def sampled() -> collections.Counter:
            t0 = time.monotonic()
            task = asyncio.create_task(traffic(srv.url, args.users, args.minutes * 60, args.seed))
            while not task.done():
                samples.append((time.monotonic() - t0, rss_mib(srv.proc.pid), pool_touched_mib(srv.url)))
                loads.append(os.getloadavg()[0])
                await asyncio.wait([task], timeout=10)
            samples.append((time.monotonic() - t0, rss_mib(srv.proc.pid), pool_touched_mib(srv.url)))
            return task.result()

        statuses = run(sampled())
        idle = wait_idle(srv.url, 10)
    warm = [(t, rss, pool) for t, rss, pool in samples if t >= args.warmup_minutes * 60]
    (_, first, pool0), (_, last, pool1) = warm[0], warm[-1]
    rss_slope, rss_err = slope_per_hour([(t, rss) for t, rss, _ in warm])
    own_slope, own_err = slope_per_hour([(t, rss - pool) for t, rss, pool in warm])
    total = sum(statuses.values())
    fivexx = sum(c for k, c in statuses.items() if k.split()[-1].startswith("5"))
    errors = sum(c for k, c in statuses.items() if not k.split()[-1].isdigit())
    lines = [
        f"soak: {args.minutes:g} min, {args.users} users, threads {args.threads}, {total} requests, 5xx={fivexx}, "
        f"client errors={errors}; idle after: {idle is not None}",
        f"soak: after {args.warmup_minutes:g} min warm-up: RSS {first:.0f} -> {last:.0f} MiB "
        f"(slope {rss_slope:+.1f} ± {rss_err:.1f} MiB/h); K/V pool touched {pool0:.0f} -> {pool1:.0f} MiB; "
        f"RSS minus touched pool {first - pool0:.0f} -> {last - pool1:.0f} MiB "
        f"(slope {own_slope:+.1f} ± {own_err:.1f} MiB/h, ± one standard error, {len(warm)} samples)",
        f"soak: 1-minute load average during the run: mean {sum(loads) / len(loads):.2f}, max {max(loads):.2f} "
        f"(the server and this client share {os.cpu_count()} cores)",
        "soak: statuses " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())),
    ]
    per_minute: dict[int, tuple[float, float]] = {}
    for t, rss, pool in samples:
        per_minute.setdefault(int(t // 60), (rss, pool))
    lines.append(
        "soak: each minute, RSS / RSS minus touched pool (MiB) "
        + " ".join(f"{m}:{rss:.0f}/{rss - pool:.0f}" for m, (rss, pool) in sorted(per_minute.items()))
    )
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"out": str(args.out)},
                    "summary": lines,
                    "statuses": dict(statuses),
                    "load_average_1min": loads,
                    "samples": [
                        {"s": round(t, 1), "rss_mib": rss, "pool_touched_mib": pool} for t, rss, pool in samples
                    ],
                },
                indent=1,
            )
        )
    ok = fivexx == 0 and errors == 0 and idle is not None
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
