"""`ridgefill-loadtest`: multi-user latency measured at the client, over streaming /v1/completions.

mixed  the RidgeFill paper's §4.8 experiment: C-1 users stream long decodes, then one new long
       prompt arrives. Reports the new request's TTFT and, for the other users, throughput
       (tokens delivered / time from their first request to their last token, so the stall is
       included) and inter-token latency p50 / p99 / max (max = the worst stall).
plain  like `vllm bench serve`: N requests at a given rate (inf = all at once), fixed prompt
       and output lengths; TTFT / TPOT / ITL percentiles and throughput.
chat   N chat requests over /v1/chat/completions that share one long system prompt (each with
       its own short user turn), at a given rate: the same percentiles, and the prompt tokens
       the server reports as cached (usage.prompt_tokens_details.cached_tokens).
compare  two JSON results side by side (e.g. fill on vs off) as a Markdown table.

Works against any OpenAI-compatible server that accepts token-id prompts and ignore_eos.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .sse import asplit_lines

# A neutral English passage; repeated and cut to the exact token count asked for.
_FILLER = (
    "The river ran past the old mill, where the miller kept a ledger of every sack of grain. "
    "In spring the water rose and the wheel turned faster; in autumn the village gathered to "
    "count the harvest and argue about the price of flour. "
)


@dataclass
class StreamRecord:
    """Client-side timestamps of one streamed request (seconds, time.perf_counter)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    fill: dict | None = None  # the usage's `ridgefill` object: present when the prefix was filled
    speculation: dict | None = None  # the usage's `speculation` object: present when drafts were verified
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens the server reused
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class Client:
    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=url.rstrip("/"), headers=headers, timeout=timeout, limits=httpx.Limits(max_connections=256)
        )
        self.model = model

    async def prompt_ids(self, n: int, salt: int) -> list[int]:
        """Exactly n token ids; `salt` makes prompts differ so no cache could share them."""
        text = f"Note {salt}. " + _FILLER * (n // 40 + 2)
        r = await self.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"][:n]

    async def stream(self, prompt: list[int], max_tokens: int, started: asyncio.Event | None = None) -> StreamRecord:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        return await self._stream("/v1/completions", body, "text", started)

    async def stream_chat(self, messages: list[dict], max_tokens: int) -> StreamRecord:
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        return await self._stream("/v1/chat/completions", body, "content")

    async def _stream(
        self, route: str, body: dict, field_name: str, started: asyncio.Event | None = None
    ) -> StreamRecord:
        rec = StreamRecord(sent=time.perf_counter())
        try:
            async with self.http.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                    return rec
                async for line in asplit_lines(r.aiter_bytes()):
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        rec.completion_tokens = chunk["usage"]["completion_tokens"]
                        rec.fill = chunk["usage"].get("ridgefill")
                        rec.speculation = chunk["usage"].get("speculation")
                        rec.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    choice = chunk["choices"][0] if chunk.get("choices") else {}
                    if choice.get("text") or (choice.get("delta") or {}).get(field_name):
                        rec.chunk_times.append(now)
                        if started is not None and not started.is_set():
                            started.set()
                    if "error" in chunk:
                        rec.error = chunk["error"]["message"]
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"
        return rec

    async def close(self) -> None:
        await self.http.aclose()


def filler_text(n: int, salt: int) -> str:
    """About n tokens of text (chat messages are text); `salt` makes texts differ."""
    return f"Note {salt}. " + _FILLER * max(1, n // 50)


# -- mixed (§4.8) ---------------------------------------------------------------------------


async def mixed_cell(client: Client, users: int, rep: int, args) -> dict:
    """One repetition at C = users: users-1 decoding, then the new long prompt."""
    others = users - 1
    prompts = [await client.prompt_ids(args.other_prompt_tokens, 1000 * rep + i) for i in range(others)]
    new_prompt = await client.prompt_ids(args.new_prompt_tokens, 1000 * rep + 999)
    started = [asyncio.Event() for _ in range(others)]
    tasks = [asyncio.create_task(client.stream(p, args.decode_tokens, e)) for p, e in zip(prompts, started)]
    for e in started:  # the new prompt arrives once every other user is decoding
        await e.wait()
    new = await client.stream(new_prompt, args.new_output_tokens)
    done = await asyncio.gather(*tasks)
    errors = [r.error for r in [new, *done] if r.error]
    cell = {
        "users": users,
        "rep": rep,
        "new_ttft_s": new.ttft if new.chunk_times else math.nan,
        "new_filled_rows": new.fill["filled_rows"] if new.fill else 0,
        "new_fill": new.fill,
        "errors": errors,
    }
    if done:
        first_sent = min(r.sent for r in done)
        last = max(r.chunk_times[-1] for r in done if r.chunk_times)
        tokens = sum(r.completion_tokens for r in done)
        itls = [x for r in done for x in r.itls]
        cell.update(
            others_tokens=tokens,
            others_throughput_tok_s=tokens / (last - first_sent),
            itl_p50_s=percentile(itls, 50),
            itl_p99_s=percentile(itls, 99),
            itl_max_s=max(itls, default=math.nan),
        )
    return cell


async def run_mixed(args) -> dict:
    client = Client(args.url, args.model, args.api_key, args.timeout)
    try:
        cells = [await mixed_cell(client, c, rep, args) for c in args.concurrency for rep in range(args.reps)]
    finally:
        await client.close()
    summary = []
    for c in args.concurrency:
        rows = [x for x in cells if x["users"] == c]
        row = {
            "users": c,
            "new_ttft_s": _median(r["new_ttft_s"] for r in rows),
            "new_filled_rows": max(r["new_filled_rows"] for r in rows),
        }
        if c > 1:
            for key in ("others_throughput_tok_s", "itl_p50_s", "itl_p99_s", "itl_max_s"):
                row[key] = _median(r[key] for r in rows)
        summary.append(row)
    return {"mode": "mixed", "settings": _settings(args), "cells": cells, "summary": summary}


def _median(values) -> float:
    return percentile([v for v in values if not math.isnan(v)], 50)


# -- plain (like vllm bench serve) -------------------------------------------------------------


async def run_plain(args) -> dict:
    client = Client(args.url, args.model, args.api_key, args.timeout)
    try:
        prompts = [await client.prompt_ids(args.prompt_tokens, i) for i in range(args.num_prompts)]
        recs, duration = await _arrivals(prompts, lambda p: client.stream(p, args.output_tokens), args)
    finally:
        await client.close()
    return {"mode": "plain", "settings": _settings(args), "summary": summarize(recs, duration)}


async def _arrivals(requests: list, send, args) -> tuple[list[StreamRecord], float]:
    """`send(request)` for each request at args.rate per second (inf: all at once), at most
    args.max_concurrency in flight; the records and the run's duration."""
    gate = asyncio.Semaphore(args.max_concurrency or len(requests))

    async def one(req):
        async with gate:
            return await send(req)

    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(requests):
        if i and args.rate != math.inf:
            await asyncio.sleep(1 / args.rate)  # NOTE: fixed inter-arrival; the rate is the experiment
        tasks.append(asyncio.create_task(one(req)))
    recs = await asyncio.gather(*tasks)
    return recs, time.perf_counter() - t0


async def run_chat(args) -> dict:
    client = Client(args.url, args.model, args.api_key, args.timeout)
    try:
        system = filler_text(args.system_tokens, 0)
        chats = [
            [{"role": "system", "content": system}, {"role": "user", "content": filler_text(args.user_tokens, i + 1)}]
            for i in range(args.num_prompts)
        ]
        recs, duration = await _arrivals(chats, lambda m: client.stream_chat(m, args.output_tokens), args)
    finally:
        await client.close()
    stats = summarize(recs, duration)
    stats["cached_tokens_total"] = sum(r.cached_tokens for r in recs)
    return {"mode": "chat", "settings": _settings(args), "summary": stats}


def summarize(recs: list[StreamRecord], duration: float) -> dict:
    """TTFT / TPOT / ITL percentiles and throughput of a run's requests."""
    ok = [r for r in recs if not r.error and r.chunk_times]
    ttft = [r.ttft for r in ok]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    itl = [x for r in ok for x in r.itls]
    stats = {
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "duration_s": duration,
        "output_throughput_tok_s": sum(r.completion_tokens for r in ok) / duration,
        "request_throughput_req_s": len(ok) / duration,
        "errors": [r.error for r in recs if r.error],
    }
    verified = [r.speculation for r in ok if r.speculation]
    if verified:  # NOTE: tokens per verification over all the run's verifications
        steps = sum(v["verifications"] for v in verified)
        stats["tokens_per_verification"] = (
            sum(v["verifications"] * v["tokens_per_verification"] for v in verified) / steps
        )
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        stats[f"{name}_mean_s"] = sum(vals) / len(vals) if vals else math.nan
        for q in (50, 90, 99):
            stats[f"{name}_p{q}_s"] = percentile(vals, q)
    return stats


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "out", "png")}


# -- output -----------------------------------------------------------------------------------


def mixed_table(result: dict) -> str:
    lines = [
        "| users C | new TTFT (s) | filled rows | others' tok/s | ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["summary"]:
        ms = lambda k: f"{r[k] * 1e3:.0f}" if k in r else "–"  # noqa: E731
        tput = f"{r['others_throughput_tok_s']:.1f}" if "others_throughput_tok_s" in r else "–"
        lines.append(
            f"| {r['users']} | {r['new_ttft_s']:.2f} | {r.get('new_filled_rows', 0)} | {tput} | {ms('itl_p50_s')} | {ms('itl_p99_s')} | {ms('itl_max_s')} |"
        )
    return "\n".join(lines)


def mixed_side_by_side(results: list[dict], labels: list[str]) -> str:
    """One row per C, each measure for every result next to each other (e.g. fill off | on)."""
    measures = [
        ("new TTFT (s)", "new_ttft_s", 1, 2),
        ("filled rows", "new_filled_rows", 1, 0),
        ("others' tok/s", "others_throughput_tok_s", 1, 1),
        ("ITL p50 (ms)", "itl_p50_s", 1e3, 0),
        ("ITL p99 (ms)", "itl_p99_s", 1e3, 0),
        ("ITL max (ms)", "itl_max_s", 1e3, 0),
    ]
    head = ["users C"] + [f"{title} {label}" for title, *_ in measures for label in labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [{r["users"]: r for r in res["summary"]} for res in results]
    for c in sorted(set().union(*rows)):
        cells = [str(c)]
        for _, key, scale, digits in measures:
            for by_c in rows:
                r = by_c.get(c, {})
                cells.append(f"{r[key] * scale:.{digits}f}" if key in r else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plain_table(result: dict) -> str:
    s = result["summary"]
    spec = f", {s['tokens_per_verification']:.2f} tokens per verification" if "tokens_per_verification" in s else ""
    if "cached_tokens_total" in s:
        spec += f", {s['cached_tokens_total']} prompt tokens cached"
    rows = [
        f"completed {s['completed']}, failed {s['failed']}, {s['duration_s']:.1f} s, "
        f"{s['output_throughput_tok_s']:.1f} output tok/s{spec}",
        "",
        "| metric | mean (ms) | p50 | p90 | p99 |",
        "|---|---|---|---|---|",
    ]
    for name in ("ttft", "tpot", "itl"):
        rows.append(
            f"| {name.upper()} | "
            + " | ".join(f"{s[f'{name}_{k}_s'] * 1e3:.1f}" for k in ("mean", "p50", "p90", "p99"))
            + " |"
        )
    return "\n".join(rows)


def plot(results: list[dict], labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if results[0]["mode"] == "mixed":
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for res, label in zip(results, labels):
            s = res["summary"]
            axes[0].plot([r["users"] for r in s], [r["new_ttft_s"] for r in s], "o-", label=label)
            more = [r for r in s if "itl_p50_s" in r]
            axes[1].plot([r["users"] for r in more], [r["others_throughput_tok_s"] for r in more], "o-", label=label)
            for key, style in (("itl_p50_s", "o-"), ("itl_p99_s", "s--"), ("itl_max_s", "^:")):
                axes[2].plot(
                    [r["users"] for r in more], [r[key] * 1e3 for r in more], style, label=f"{label} {key[4:-2]}"
                )
        for ax, title in zip(axes, ("new request TTFT (s)", "others' throughput (tok/s)", "others' ITL (ms)")):
            ax.set_title(title)
            ax.set_xlabel("users C")
            ax.legend(fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        names = ["ttft", "tpot", "itl"]
        width = 0.8 / len(results)
        for i, (res, label) in enumerate(zip(results, labels)):
            s = res["summary"]
            for j, q in enumerate(("p50", "p99")):
                ax.bar(
                    [k + i * width + j * width / 2 for k in range(3)],
                    [s[f"{n}_{q}_s"] * 1e3 for n in names],
                    width / 2,
                    label=f"{label} {q}",
                )
        ax.set_xticks(range(3), [n.upper() for n in names])
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(paths: list[Path], png: Path | None) -> str:
    results = [json.loads(p.read_text()) for p in paths]
    labels = [p.stem for p in paths]
    if png:
        plot(results, labels, png)
    if results[0]["mode"] == "mixed":
        return mixed_side_by_side(results, labels)
    return "\n\n".join(f"### {label}\n\n{plain_table(r)}" for r, label in zip(results, labels))


# -- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ridgefill-loadtest", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for name in ("mixed", "plain", "chat"):
        p = sub.add_parser(name)
        p.add_argument("--url", default="http://127.0.0.1:8000")
        p.add_argument("--model", default=None, help="model name to send (default: none, server's own)")
        p.add_argument("--api-key", default=None)
        p.add_argument("--timeout", type=float, default=600.0)
        p.add_argument("--out", type=Path, required=True, help="JSON result file")
        p.add_argument("--png", type=Path, default=None, help="plot file")
    m = sub.choices["mixed"]
    m.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8], help="C values: users incl. the new one")
    m.add_argument("--reps", type=int, default=2)
    m.add_argument("--new-prompt-tokens", type=int, default=4096)
    m.add_argument("--new-output-tokens", type=int, default=4)
    m.add_argument("--other-prompt-tokens", type=int, default=64)
    m.add_argument("--decode-tokens", type=int, default=256, help="tokens each other user decodes")
    p = sub.choices["plain"]
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    ch = sub.choices["chat"]
    ch.add_argument("--num-prompts", type=int, default=16)
    ch.add_argument("--system-tokens", type=int, default=2048, help="about this many tokens of shared system prompt")
    ch.add_argument("--user-tokens", type=int, default=64, help="about this many tokens of each user turn")
    ch.add_argument("--output-tokens", type=int, default=32)
    ch.add_argument("--rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    ch.add_argument("--max-concurrency", type=int, default=None)
    c = sub.add_parser("compare", help="two or more result files side by side")
    c.add_argument("results", type=Path, nargs="+")
    c.add_argument("--png", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "compare":
        print(compare(args.results, args.png))
        return 0
    runs = {"mixed": run_mixed, "plain": run_plain, "chat": run_chat}
    result = asyncio.run(runs[args.mode](args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    if args.png:
        plot([result], [args.out.stem], args.png)
    print((mixed_table if args.mode == "mixed" else plain_table)(result))
    failed = any(c["errors"] for c in result["cells"]) if args.mode == "mixed" else result["summary"]["failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
