"""The wedge cases: several long prompts prefill at once and together outgrow the free KV
blocks. Every request must finish (the scheduler preempts the newest), within a time bound.

  python scripts/reliability/wedge.py --case three-1500   (3 x 1,500 tokens, 128-block pool)
  python scripts/reliability/wedge.py --case fill-32       (32 requests, --fill plain, 160 blocks)
  python scripts/reliability/wedge.py --case four-7000     (4 x 7,000 tokens, default pool; slow)
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from _server import idle_state, metric, run, serve

CASES = {  # name -> (requests, prompt tokens, max_tokens, server flags)
    "three-1500": (3, 1500, 8, ["--num-blocks", "128"]),
    "fill-32": (32, 600, 8, ["--num-blocks", "160", "--fill", "plain", "--fill-tail", "128"]),
    "four-7000": (4, 7000, 4, []),
}


async def complete_all(url: str, n: int, tokens: int, max_tokens: int, timeout: float) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=n)) as client:

        async def one(i: int) -> str:
            ids = (
                await client.post(
                    "/tokenize",
                    json={
                        "prompt": f"Document {i}. " + "The mill turned slowly. " * tokens,
                        "add_special_tokens": False,
                    },
                )
            ).json()["tokens"][:tokens]
            r = await client.post(
                "/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            )
            return r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else f"HTTP {r.status_code}"

        return list(await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=sorted(CASES), required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="the bound within which all must finish")
    args = p.parse_args()
    n, tokens, max_tokens, flags = CASES[args.case]
    with serve("--threads", str(args.threads), "--max-num-seqs", str(max(n, 16)), *flags) as srv:
        t0 = time.monotonic()
        try:
            reasons = run(complete_all(srv.url, n, tokens, max_tokens, args.timeout))
        except TimeoutError:
            reasons = ["timed out"]
        took = time.monotonic() - t0
        text = httpx.get(srv.url + "/metrics").text
        preempted = metric(text, "ridgefill_preemptions_total")
        idle = idle_state(srv.url)
    ok = reasons == ["length"] * n and idle == (0.0, 0.0, 0.0)
    print(
        f"wedge: case={args.case} requests={n} x {tokens} tokens: finished {reasons.count('length')}/{n} "
        f"in {took:.1f} s; preemptions={preempted:.0f}; idle after={idle} -> {'PASS' if ok else 'FAIL'}"
    )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
