#!/usr/bin/env python3
"""ridgefill serve and llama.cpp's llama-server side by side on one GGUF, one neutral client.

Both servers load the same GGUF with the same thread count (ours `--threads N`; llama-server
`-t N -tb N`). One client (httpx, streaming `/v1/completions`, `stream: true`) sends both the
same request body: the prompt as token ids (so both see exactly the same tokens, BOS included,
and no tokenizer or chat template differs), greedy, `ignore_eos`, usage in the stream. Our
arms add only `"ridgefill": {"mode": ...}` (fill off / on); llama-server gets no such field.

Phases (every number is per arm, rounds alternate the arms' order: A B C, C B A, ...):
  ttft    C = 1, one cold prefill per request at each of --lengths: every request a different
          slice of the text (no shared prefix past BOS) and `cache_prompt: false`; arms
          llama-server, ours fill off, ours fill on (with --fill-config). TTFT = request sent to
          first streamed content token.
  decode  C = --concurrency streams at once (--decode-prompt tokens each, --decode-tokens out):
          output tok/s (all streams' completion tokens / wall time of the batch), ITL p50/p99
          (gaps between content chunks, all streams pooled), TTFT p50.
  chat    --chat-users users at once with the same --chat-system tokens of system prompt and
          different --chat-question tokens of question; prefix caching on in both servers
          (llama-server `cache_prompt: true`; ours its default). Each server is primed with one
          request of the system prompt first (untimed), so the rounds measure the shared-prefix
          steady state.

Both servers stay up for the whole run; only one does work at a time (the client waits for
every stream of a step before the next step starts), the other sits idle. Keeping both loaded
avoids timing model loads and keeps the two processes' page caches equally warm; idle, neither
uses CPU beyond an occasional poll (load at start and end is in the output).

  .venv/bin/python benchmarks/llama_server_side_by_side.py --model gemma3-270m \
      --fill-config benchmarks/tune/gemma3-270m-16k/fill.toml --threads 2 --rounds 3 \
      --out benchmarks/llama_server_side_by_side/gemma3-270m

Gemma 3 (sliding-window layers): llama-server's default SWA cache cannot roll back, so it
recomputes the whole shared system prompt (cached tokens 0 in the chat table); pass
`--llama-args "--swa-full"` for its prefix reuse (smoke run: then the slot that held the prefix
reuses it, a concurrent user on another slot still starts cold).

The llama-server binary: --llama-server PATH, else scripts/build_llama_server.sh's cache
(~/.cache/ridgefill/llama-server/0.3.36/bin/llama-server), else `llama-server` on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ridgefill_clients.sse import asplit_lines

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA = "llama-server"
OURS_OFF = "ours fill off"
OURS_ON = "ours fill on"
OURS = "ours"

# -- pure parts (tests/clients/test_side_by_side.py) ------------------------------------------


def percentile(xs: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no samples."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class StreamRecord:
    """One streamed request as the client saw it; times in seconds from time.perf_counter()."""

    arm: str
    sent: float
    content_times: list[float] = field(default_factory=list)  # each chunk that carried text
    done: float | None = None
    prompt_tokens: int | None = None  # from the stream's usage
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # ours: usage.prompt_tokens_details; llama-server: timings.cache_n
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.content_times[0] - self.sent if self.content_times else None

    @property
    def itls(self) -> list[float]:
        t = self.content_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tokens_out(self) -> int:
        """Completion tokens: the usage count when the stream gave one, else content chunks."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.content_times)


def summarize(records: list[StreamRecord], wall: float | None = None) -> dict:
    """TTFT / ITL / throughput over a set of streams (a step's, or all rounds' of an arm).

    wall: the batch's wall time (first send to last finish); when None it is taken from the
    records themselves. out_tok_s = all completion tokens / wall."""
    ok = [r for r in records if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itls]
    if wall is None and ok:
        wall = max(r.done or r.sent for r in ok) - min(r.sent for r in ok)
    tokens = sum(r.tokens_out for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_max_s": max(ttfts) if ttfts else None,
        "itl_p50_ms": _ms(percentile(itls, 50)),
        "itl_p99_ms": _ms(percentile(itls, 99)),
        "itl_samples": len(itls),
        "tokens_out": tokens,
        "wall_s": wall,
        "out_tok_s": tokens / wall if wall else None,
        "prompt_tokens": sorted({r.prompt_tokens for r in ok if r.prompt_tokens is not None}),
        "cached_tokens_mean": _mean([r.cached_tokens for r in ok if r.cached_tokens is not None]),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def pooled(steps: list[dict]) -> dict:
    """All rounds of one arm: streams pooled for TTFT/ITL, throughput as the mean of the
    rounds' (each round's batch has its own wall time)."""
    records = [r for s in steps for r in s["records"]]
    out = summarize(records)
    rates = [s["summary"]["out_tok_s"] for s in steps if s["summary"]["out_tok_s"]]
    out["out_tok_s"] = _mean(rates)
    out["out_tok_s_rounds"] = rates
    out["wall_s"] = None
    return out


def build_prompt_ids(corpus: list[int], length: int, offset: int, bos: int | None) -> list[int]:
    """Exactly `length` token ids: BOS (when the model has one) and then the corpus from
    `offset` on, wrapping around at its end. Different offsets give prompts that share no
    prefix past BOS (as long as the corpus does not repeat itself)."""
    if length < 1:
        raise ValueError(f"prompt length {length} < 1")
    if not corpus:
        raise ValueError("empty corpus")
    head = [bos] if bos is not None else []
    need = length - len(head)
    n = len(corpus)
    body = [corpus[(offset + i) % n] for i in range(need)]
    return head + body


def arm_order(arms: list[str], round_index: int) -> list[str]:
    """Round 0 runs the arms as given, round 1 reversed, and so on: every arm runs first and
    last equally often over an even number of rounds."""
    return list(arms) if round_index % 2 == 0 else list(reversed(arms))


def parse_sse_line(line: str) -> dict | None | str:
    """One line of an SSE stream: its JSON payload, "done" for `data: [DONE]`, None otherwise."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "done"
    return json.loads(data)


def apply_chunk(rec: StreamRecord, chunk: dict, now: float) -> None:
    """Folds one streamed /v1/completions chunk into the record (text -> a content time,
    usage -> counts; llama-server's `timings` -> cached tokens)."""
    if "error" in chunk:
        rec.error = json.dumps(chunk["error"])[:300]
        return
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            rec.content_times.append(now)
            break
    usage = chunk.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        rec.completion_tokens = usage.get("completion_tokens", rec.completion_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = details["cached_tokens"]
    timings = chunk.get("timings")
    if timings and timings.get("cache_n") is not None:
        rec.cached_tokens = timings["cache_n"]


def markdown_tables(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# llama-server vs ridgefill serve: {result['model']}",
        "",
        f"Machine: {m['cpu']} ({m['cores']} CPUs; avx2: {m['avx2']}, avx512f: {m['avx512f']}); "
        f"threads {result['threads']} each; load at start {m['load_start']}, at end {m.get('load_end')}; "
        f"rounds {result['rounds']}, arm order alternated. {result['versions']['llama-server']}; "
        f"ridgefill {result['versions']['ridgefill']}."
        + (f" ISA caps for ours: {m['isa_caps']}." if m.get("isa_caps") else ""),
        "",
    ]
    ttft = result["phases"].get("ttft")
    if ttft:
        arms = ttft["arms"]
        lines += ["## C = 1 TTFT (cold prefill; s, median over rounds)", ""]
        lines += [
            "| prompt tokens | " + " | ".join(arms) + " | " + " | ".join(f"{LLAMA} / {a}" for a in arms[1:]) + " |"
        ]
        lines += ["|---" * (1 + 2 * len(arms) - 1) + "|"]
        for row in ttft["rows"]:
            vals = [row["arms"][a]["ttft_p50_s"] for a in arms]
            ratios = [(vals[0] / v if (v and vals[0]) else None) for v in vals[1:]]
            lines.append(
                f"| {row['tokens']} | "
                + " | ".join(_f(v, 3) for v in vals)
                + " | "
                + " | ".join(_f(r, 2) + "x" for r in ratios)
                + " |"
            )
        lines.append("")
        lines.append("(ratio > 1: ours is faster.)")
        lines.append("")
    dec = result["phases"].get("decode")
    if dec:
        lines += [
            f"## Concurrent decode ({dec['prompt_tokens']}-token prompts, {dec['max_tokens']} tokens out each)",
            "",
        ]
        lines += ["| C | arm | out tok/s | ITL p50 ms | ITL p99 ms | TTFT p50 s |", "|---|---|---|---|---|---|"]
        for row in dec["rows"]:
            for a, s in row["arms"].items():
                lines.append(
                    f"| {row['concurrency']} | {a} | {_f(s['out_tok_s'], 1)} | {_f(s['itl_p50_ms'], 1)} | {_f(s['itl_p99_ms'], 1)} | {_f(s['ttft_p50_s'], 3)} |"
                )
        lines.append("")
    chat = result["phases"].get("chat")
    if chat:
        lines += [
            f"## Shared system prompt ({chat['users']} users at once, {chat['system_tokens']}-token system prompt, "
            f"{chat['question_tokens']}-token questions, {chat['max_tokens']} tokens out; prefix caching on)",
            "",
            "| arm | TTFT p50 s | TTFT max s | out tok/s | ITL p50 ms | ITL p99 ms | cached prompt tokens (mean) |",
            "|---|---|---|---|---|---|---|",
        ]
        for a, s in chat["arms"].items():
            lines.append(
                f"| {a} | {_f(s['ttft_p50_s'], 3)} | {_f(s['ttft_max_s'], 3)} | {_f(s['out_tok_s'], 1)} | {_f(s['itl_p50_ms'], 1)} | "
                f"{_f(s['itl_p99_ms'], 1)} | {_f(s['cached_tokens_mean'], 0)} |"
            )
        lines.append("")
    for note in result.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def _f(x, nd: int) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# -- machine, binaries, servers ---------------------------------------------------------------


# Environment variables that cap the instruction set of ours (ridgefill's packed kernel, ATen's kernels, MKL,
# oneDNN, our attention kernel's float16/int8 row widening): set together, they make this machine run ours as
# an AVX2 CPU would (our attention kernel's own loops still pick their clone by CPU detection).
ISA_CAP_VARS = (
    "RIDGEFILL_PACKED_ISA",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "DNNL_MAX_CPU_ISA",
    "RIDGEFILL_CPU_ATTN_WIDEN",
)


def machine_info() -> dict:
    cpu, flags = platform.processor() or "?", set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                flags = set(line.split(":", 1)[1].split())
    except (OSError, subprocess.SubprocessError):
        pass
    if not flags and Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "load_start": [round(x, 2) for x in os.getloadavg()],
        # ISA caps in force for ours (an AVX2 CPU emulated on an AVX-512 one), if any
        "isa_caps": {k: os.environ[k] for k in ISA_CAP_VARS if k in os.environ},
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def find_llama_server(given: str | None) -> Path:
    if given:
        p = Path(given)
        if not (p.is_file() and os.access(p, os.X_OK)):
            sys.exit(f"--llama-server {given}: no executable there")
        return p
    cache = Path(
        os.environ.get("RIDGEFILL_LLAMA_SERVER_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ridgefill" / "llama-server"
    )
    p = cache / LLAMA_CPP_PYTHON_VERSION / "bin" / "llama-server"
    if p.is_file():
        return p
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    sys.exit(
        f"no llama-server binary: build it with `bash scripts/build_llama_server.sh` (expected at {p}) or pass --llama-server PATH"
    )


def find_model(name: str) -> Path:
    p = Path(name)
    if p.suffix == ".gguf":
        if not p.is_file():
            sys.exit(f"--model {name}: no such GGUF file")
        return p.resolve()
    try:
        from ridgefill_runtime.loader.packaged import PACKAGED, packaged_model_path
    except ImportError as e:
        sys.exit(
            f"cannot import ridgefill_runtime to resolve --model {name} ({e}); run with .venv/bin/python or pass a .gguf path"
        )
    if name not in PACKAGED:
        sys.exit(f"--model {name}: neither a .gguf file nor a packaged model ({', '.join(PACKAGED)})")
    try:
        return packaged_model_path(name)
    except Exception as e:  # ModelLoadError: the chunk packages are missing
        sys.exit(f"--model {name}: {e}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict | None = None):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        t0 = time.perf_counter()
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        import httpx

        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-2000:]
                raise RuntimeError(
                    f"{self.name} exited with status {self.proc.returncode} while starting; log {self.log_path}:\n{tail}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} not ready within {timeout:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()


# -- the client -------------------------------------------------------------------------------


async def stream_one(client, url: str, body: dict, arm: str) -> StreamRecord:
    rec = StreamRecord(arm=arm, sent=time.perf_counter())
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in asplit_lines(resp.aiter_bytes()):
                now = time.perf_counter()
                msg = parse_sse_line(line)
                if msg == "done":
                    break
                if isinstance(msg, dict):
                    apply_chunk(rec, msg, now)
    except Exception as e:  # a broken stream is a failed request, reported, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    rec.done = time.perf_counter()
    return rec


async def run_step(client, url: str, bodies: list[dict], arm: str) -> dict:
    t0 = time.perf_counter()
    records = await asyncio.gather(*(stream_one(client, url, b, arm) for b in bodies))
    wall = time.perf_counter() - t0
    for r in records:
        if r.error:
            print(f"  {arm}: request failed: {r.error}", file=sys.stderr)
    return {"records": list(records), "summary": summarize(list(records), wall)}


def body_for(arm: str, ids: list[int], max_tokens: int, cache_prompt: bool) -> dict:
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "cache_prompt": cache_prompt,  # llama-server's switch; ridgefill ignores unknown fields
    }
    # NOTE: the decode and chat phases (arm OURS) run with the fill off: a server whose config
    # turns the fill on would otherwise fill the chat's prompts, and on a sliding-window model
    # filled requests take no cached blocks, so the chat would measure no prefix cache at all
    if arm in (OURS_OFF, OURS):
        body["ridgefill"] = {"mode": "off"}
    elif arm == OURS_ON:
        body["ridgefill"] = {"mode": "plain"}
    return body


# -- main -------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default="gemma3-270m",
        help="a .gguf path or a packaged model name (gemma3-270m, qwen2.5-coder-0.5b, ...)",
    )
    p.add_argument(
        "--fill-config",
        default=None,
        help="ridgefill TOML with a [fill] table (mode plain, maps): adds the 'ours fill on' arm",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--phases", default="ttft,decode,chat")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    p.add_argument("--ttft-max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    p.add_argument("--decode-prompt", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--chat-users", type=int, default=8)
    p.add_argument("--chat-system", type=int, default=2048)
    p.add_argument("--chat-question", type=int, default=48)
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument(
        "--text",
        nargs="+",
        default=None,
        help="text files/folders tokenized into the prompts (default: the Python HOWTOs when installed, else this repo's *.md)",
    )
    p.add_argument("--llama-server", default=None)
    p.add_argument("--llama-args", default="", help="extra llama-server arguments (one string)")
    p.add_argument("--ours-args", default="", help="extra `ridgefill serve` arguments (one string)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="ours: K/V pool")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--request-timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def corpus_text(paths: list[str] | None) -> str:
    if paths is None:
        howto = Path("/usr/share/doc/python3.11-doc/html/_sources/howto")
        files = sorted(howto.glob("*.txt")) if howto.is_dir() else sorted(REPO.glob("**/*.md"))
    else:
        files = []
        for p in map(Path, paths):
            files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    if not files:
        sys.exit("no text files for the prompts (--text)")
    return "\n\n".join(f.read_text(errors="replace") for f in files)


async def main_async(
    args,
    servers: dict[str, Server],
    arms_ttft: list[str],
    corpus: list[int],
    bos: int | None,
    max_len: int,
    result: dict,
):
    import httpx

    phases = set(args.phases.split(","))
    urls = {LLAMA: servers[LLAMA].url, OURS_OFF: servers[OURS].url, OURS_ON: servers[OURS].url, OURS: servers[OURS].url}
    serial = 0  # every prompt a fresh corpus offset

    def fresh(length: int) -> list[int]:
        nonlocal serial
        serial += 1
        return build_prompt_ids(corpus, length, (serial * 7919) % len(corpus), bos)

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        # warm-up: each arm once, short (first-request costs: allocations, kernel dispatch)
        for arm in arms_ttft:
            await run_step(client, urls[arm], [body_for(arm, fresh(64), 4, False)], arm)
        if "ttft" in phases:
            rows = []
            for length in args.lengths:
                tokens = min(length, max_len - args.ttft_max_tokens)
                steps = {a: [] for a in arms_ttft}
                for r in range(args.rounds):
                    for arm in arm_order(arms_ttft, r):
                        step = await run_step(
                            client, urls[arm], [body_for(arm, fresh(tokens), args.ttft_max_tokens, False)], arm
                        )
                        steps[arm].append(step)
                        print(
                            f"ttft {tokens:>6} round {r} {arm:14s} {_f(step['summary']['ttft_p50_s'], 3)} s", flush=True
                        )
                rows.append(
                    {
                        "requested": length,
                        "tokens": tokens,
                        "arms": {a: pooled(s) for a, s in steps.items()},
                        "steps": steps,
                    }
                )
            result["phases"]["ttft"] = {"arms": arms_ttft, "max_tokens": args.ttft_max_tokens, "rows": rows}
        if "decode" in phases:
            rows = []
            for c in args.concurrency:
                steps = {LLAMA: [], OURS: []}
                for r in range(args.rounds):
                    for arm in arm_order([LLAMA, OURS], r):
                        bodies = [body_for(arm, fresh(args.decode_prompt), args.decode_tokens, False) for _ in range(c)]
                        step = await run_step(client, urls[arm], bodies, arm)
                        steps[arm].append(step)
                        s = step["summary"]
                        print(
                            f"decode C={c:<3} round {r} {arm:14s} {_f(s['out_tok_s'], 1)} tok/s ITL p50 {_f(s['itl_p50_ms'], 1)} ms",
                            flush=True,
                        )
                rows.append({"concurrency": c, "arms": {a: pooled(s) for a, s in steps.items()}, "steps": steps})
            result["phases"]["decode"] = {
                "prompt_tokens": args.decode_prompt,
                "max_tokens": args.decode_tokens,
                "rows": rows,
            }
        if "chat" in phases:
            system = build_prompt_ids(corpus, args.chat_system, len(corpus) // 3, bos)
            steps = {LLAMA: [], OURS: []}
            for arm in (LLAMA, OURS):  # prime: the system prompt computed once, untimed
                q = build_prompt_ids(corpus, args.chat_question, (serial * 7919 + 11) % len(corpus), None)
                await run_step(client, urls[arm], [body_for(arm, system + q, 4, True)], arm)
            for r in range(args.rounds):
                for arm in arm_order([LLAMA, OURS], r):
                    bodies = []
                    for _ in range(args.chat_users):
                        serial += 1
                        q = build_prompt_ids(corpus, args.chat_question, (serial * 7919) % len(corpus), None)
                        bodies.append(body_for(arm, system + q, args.chat_tokens, True))
                    step = await run_step(client, urls[arm], bodies, arm)
                    steps[arm].append(step)
                    s = step["summary"]
                    print(
                        f"chat round {r} {arm:14s} TTFT p50 {_f(s['ttft_p50_s'], 3)} s, cached {_f(s['cached_tokens_mean'], 0)}",
                        flush=True,
                    )
            result["phases"]["chat"] = {
                "users": args.chat_users,
                "system_tokens": args.chat_system,
                "question_tokens": args.chat_question,
                "max_tokens": args.chat_tokens,
                "arms": {a: pooled(s) for a, s in steps.items()},
                "steps": steps,
            }


def _jsonable(x):
    if isinstance(x, StreamRecord):
        d = asdict(x)
        d["ttft"] = x.ttft
        return d
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx

    machine = machine_info()
    binary = find_llama_server(args.llama_server)
    gguf = find_model(args.model)
    if args.fill_config and not Path(args.fill_config).is_file():
        sys.exit(f"--fill-config {args.fill_config}: no such file")
    ridgefill_bin = Path(sys.executable).parent / "ridgefill"
    if not ridgefill_bin.exists():
        ridgefill_bin = shutil.which("ridgefill")
        if not ridgefill_bin:
            sys.exit("no `ridgefill` command next to this python or on PATH; run with .venv/bin/python")
    args.out.mkdir(parents=True, exist_ok=True)

    longest = max(args.lengths) + args.ttft_max_tokens if "ttft" in args.phases else 0
    n_par = max(max(args.concurrency), args.chat_users, 1)
    ctx = max(
        longest,
        max(args.concurrency) * (args.decode_prompt + args.decode_tokens),
        args.chat_users * (args.chat_system + args.chat_question + args.chat_tokens) + args.chat_system,
    )
    ctx = -(-ctx // 256) * 256
    llama_cmd = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-c",
        str(ctx),
        "-np",
        str(n_par),
        "-kvu",
        "--no-webui",
    ] + args.llama_args.split()
    ours_cmd = [
        str(ridgefill_bin),
        "serve",
        "--model",
        str(gguf),
        "--threads",
        str(args.threads),
        "--port",
        str(free_port()),
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--max-num-seqs",
        str(max(n_par, 16)),
        "--log-level",
        "warning",
    ]
    if args.fill_config:
        ours_cmd[2:2] = ["--config", str(Path(args.fill_config).resolve())]
    ours_cmd += args.ours_args.split()
    env = dict(os.environ)
    servers = {
        LLAMA: Server(LLAMA, llama_cmd, int(llama_cmd[llama_cmd.index("--port") + 1]), args.out / "llama-server.log"),
        OURS: Server(OURS, ours_cmd, int(ours_cmd[ours_cmd.index("--port") + 1]), args.out / "ridgefill.log", env),
    }
    versions = {
        "llama-server": subprocess.run([str(binary), "--version"], capture_output=True, text=True)
        .stderr.strip()
        .replace("\n", "; ")
        or "?"
    }
    try:
        from importlib.metadata import version

        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        versions["ridgefill"] = f"{version('ridgefill')} (git {rev})"
        versions["torch"] = version("torch")
    except Exception as e:
        versions.setdefault("ridgefill", f"? ({e})")
    arms_ttft = [LLAMA, OURS_OFF] + ([OURS_ON] if args.fill_config else [])
    result = {
        "model": args.model,
        "gguf": str(gguf),
        "threads": args.threads,
        "rounds": args.rounds,
        "machine": machine,
        "versions": versions,
        "commands": {LLAMA: llama_cmd, OURS: ours_cmd},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "phases": {},
        "notes": [
            "one client (httpx, streaming /v1/completions), prompts sent as token ids (BOS included), greedy, ignore_eos; "
            "ours' arms add only the request field ridgefill.mode",
            "both servers up for the whole run, only one working at a time; arm order alternates by round",
            f"llama-server: -c {ctx} -np {n_par} -kvu (one K/V pool shared by the slots), OpenMP and flash-attn at the build's defaults",
        ],
    }
    if "--swa-full" not in args.llama_args.split():
        result["notes"].append(
            "llama-server without --swa-full: for sliding-window models (Gemma 3) its prefix cache cannot be reused"
        )
    started = []
    try:
        for key in (LLAMA, OURS):
            print(f"starting {key}: {' '.join(servers[key].cmd)}", flush=True)
            result.setdefault("load_s", {})[key] = servers[key].start(args.start_timeout)
            started.append(key)
        ours_url, llama_url = servers[OURS].url, servers[LLAMA].url
        text = corpus_text(args.text)
        tok = httpx.post(ours_url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=600).json()
        corpus, max_len = tok["tokens"], tok["max_model_len"]
        with_bos = httpx.post(
            ours_url + "/tokenize", json={"prompt": "a", "add_special_tokens": True}, timeout=60
        ).json()["tokens"]
        bare = httpx.post(ours_url + "/tokenize", json={"prompt": "a", "add_special_tokens": False}, timeout=60).json()[
            "tokens"
        ]
        bos = with_bos[0] if len(with_bos) > len(bare) else None
        sample = text[:4000]
        theirs = (
            httpx.post(llama_url + "/tokenize", json={"content": sample, "add_special": False}, timeout=60)
            .json()
            .get("tokens")
        )
        ours_sample = httpx.post(
            ours_url + "/tokenize", json={"prompt": sample, "add_special_tokens": False}, timeout=60
        ).json()["tokens"]
        result["tokenizer_agreement_first_4000_chars"] = theirs == ours_sample
        result["corpus_tokens"], result["max_model_len"], result["bos"] = len(corpus), max_len, bos
        print(
            f"corpus {len(corpus)} tokens, ours max_model_len {max_len}, BOS {bos}, tokenizers agree on a sample: {theirs == ours_sample}",
            flush=True,
        )
        if any(length + args.ttft_max_tokens > max_len for length in args.lengths):
            result["notes"].append(
                f"prompt lengths over max_model_len - max_tokens ({max_len} - {args.ttft_max_tokens}) are cut to it (column 'prompt tokens')"
            )
        asyncio.run(main_async(args, servers, arms_ttft, corpus, bos, max_len, result))
    finally:
        for key in reversed(started):
            servers[key].stop()
    machine["load_end"] = [round(x, 2) for x in os.getloadavg()]
    (args.out / "result.json").write_text(json.dumps(_jsonable(result), indent=1) + "\n")
    md = markdown_tables(result)
    (args.out / "result.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
