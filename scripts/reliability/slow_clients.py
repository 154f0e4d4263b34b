"""Slow and idle clients against a `serve` subprocess, two cases (loopback only; each ends by itself).

flood (the default): open-files limit 1,024, 200 half-sent bodies (Content-Length 1000, 10 bytes
sent) and 1,100 idle connections, while /health is probed on fresh connections (about a minute).

trickle: `--max-connections 32` and 40 bodies trickled one byte every 25 s (each part inside
server.body_timeout_s, so only server.body_deadline_s ends them), while /health and a short
completion are probed on fresh connections (about 90 s).

Each reports how many connections the server closed, how the probes fared, and what the server logged.

    .venv/bin/python scripts/reliability/slow_clients.py [--half-sent 200 --idle 1100]
    .venv/bin/python scripts/reliability/slow_clients.py --case trickle [--tricklers 40 --max-connections 32]
"""

from __future__ import annotations

import argparse
import selectors
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import Server, raise_own_open_files  # noqa: E402

HALF_SENT = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b'Content-Length: 1000\r\n\r\n{"prompt":'
)


def open_connections(port: int, count: int, first_bytes: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if first_bytes:
            s.sendall(first_bytes)
        s.setblocking(False)
        socks.append(s)
    return socks


def watch_closes(groups: dict[str, list[socket.socket]], until: float) -> dict[str, dict]:
    """Read every socket until the server closes it or `until`; per group: closed, the
    seconds of the last close, and how many got an HTTP 408 first."""
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytearray] = {}
    for name, socks in groups.items():
        for s in socks:
            sel.register(s, selectors.EVENT_READ, name)
            got[s] = bytearray()
    start = time.monotonic()
    out = {
        name: {"opened": len(socks), "closed": 0, "answered_408": 0, "last_close_s": 0.0, "closes_s": []}
        for name, socks in groups.items()
    }
    while sel.get_map() and time.monotonic() < until:
        for key, _ in sel.select(timeout=0.5):
            s, name = key.fileobj, key.data
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                chunk = b""
            except BlockingIOError:
                continue
            if chunk:
                got[s] += chunk
                continue
            sel.unregister(s)
            stats = out[name]
            stats["closed"] += 1
            stats["closes_s"].append(time.monotonic() - start)
            stats["answered_408"] += got[s].startswith(b"HTTP/1.1 408")
    for s in list(got):
        s.close()
    return out


def probe_health(url: str, stop: threading.Event, results: list) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            status = httpx.get(url + "/health", timeout=5, headers={"Connection": "close"}).status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        results.append((status, time.monotonic() - t0))
        stop.wait(0.5)


def trickle(socks: list[socket.socket], every_s: float, stop: threading.Event) -> None:
    """One byte to each socket every `every_s` until `stop`; a socket the server closed is dropped."""
    live = list(socks)
    while live and not stop.wait(every_s):
        for s in list(live):
            try:
                s.send(b" ")
            except OSError:
                live.remove(s)


def probe_completion(url: str, stop: threading.Event, results: list) -> None:
    """A short greedy completion on a fresh connection every 2 s: what a normal client sees."""
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=30, headers={"Connection": "close"})
            status = r.status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        results.append((status, time.monotonic() - t0))
        stop.wait(2.0)


def summarize(name: str, results: list) -> str:
    ok = sum(status == 200 for status, _ in results)
    others = sorted({str(status) for status, _ in results if status != 200}) or "none"
    slowest = max((s for _, s in results), default=0)
    return f"{name}: {ok}/{len(results)} answered 200, slowest {slowest:.2f} s; others: {others}"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--case", choices=("flood", "trickle"), default="flood")
    p.add_argument("--half-sent", type=int, default=200)
    p.add_argument("--idle", type=int, default=1100)
    p.add_argument("--open-files", type=int, default=1024, help="the server's open-files limit (soft and hard)")
    p.add_argument("--header-timeout-s", type=float, default=10)
    p.add_argument("--body-timeout-s", type=float, default=10)
    p.add_argument("--tricklers", type=int, default=40, help="trickle: bodies sent a byte at a time")
    p.add_argument("--trickle-every-s", type=float, default=25, help="trickle: seconds between bytes")
    p.add_argument("--max-connections", type=int, default=32, help="trickle: the server's connection cap")
    p.add_argument("--trickle-body-timeout-s", type=float, default=30, help="trickle: server.body_timeout_s")
    p.add_argument("--body-deadline-s", type=float, default=60, help="trickle: server.body_deadline_s")
    args = p.parse_args()
    raise_own_open_files()
    return run_trickle(args) if args.case == "trickle" else run_flood(args)


def run_trickle(args) -> int:
    srv = Server(
        "--max-connections",
        str(args.max_connections),
        "--body-timeout-s",
        str(args.trickle_body_timeout_s),
        "--body-deadline-s",
        str(args.body_deadline_s),
    )
    lines_before = len(srv.log)
    stop, health, completions = threading.Event(), [], []
    try:
        tricklers = open_connections(srv.port, args.tricklers, HALF_SENT)
        trickler = threading.Thread(target=trickle, args=(tricklers, args.trickle_every_s, stop), daemon=True)
        probes = [
            threading.Thread(target=probe_health, args=(srv.url, stop, health), daemon=True),
            threading.Thread(target=probe_completion, args=(srv.url, stop, completions), daemon=True),
        ]
        for t in (trickler, *probes):
            t.start()
        until = time.monotonic() + args.body_deadline_s + 20
        closes = watch_closes({"tricklers": tricklers}, until)["tricklers"]
        stop.set()
        for t in probes:
            t.join(35)
        alive_after = httpx.get(srv.url + "/health", timeout=5).status_code
    finally:
        stop.set()
        rc = srv.stop()
    print(
        f"trickle: {args.tricklers} bodies sent one byte every {args.trickle_every_s:g} s at --max-connections "
        f"{args.max_connections} (body_timeout_s {args.trickle_body_timeout_s:g}, body_deadline_s "
        f"{args.body_deadline_s:g})"
    )
    print(
        f"tricklers: {closes['closed']}/{closes['opened']} closed by the server, the last after "
        f"{max(closes['closes_s'], default=0):.1f} s, {closes['answered_408']} answered 408 first, "
        f"{closes['closed'] - closes['answered_408']} closed without an answer (the oldest still-sending, "
        f"for a new connection at the cap)"
    )
    print(summarize("/health during the run", health))
    print(summarize("completions during the run", completions))
    print_log(srv, lines_before, alive_after, rc)
    return 0


def print_log(srv: Server, lines_before: int, alive_after: int, rc: int | None) -> None:
    log = srv.non_access_lines(lines_before)
    access = len(srv.log) - lines_before - len(log)
    print(
        f"server log during the run: {access} access lines (one per request), {len(log)} other lines, "
        f"{sum('Traceback' in line for line in log)} tracebacks; /health after: {alive_after}; "
        f"exit status after SIGTERM: {rc}"
    )
    for line in log[:8]:
        print("  log:", line.rstrip()[:160])


def run_flood(args) -> int:
    srv = Server(
        "--num-blocks",
        "64",
        "--max-num-seqs",
        "4",
        "--header-timeout-s",
        str(args.header_timeout_s),
        "--body-timeout-s",
        str(args.body_timeout_s),
        open_files=args.open_files,
    )
    lines_before = len(srv.log)
    stop, health = threading.Event(), []
    prober = threading.Thread(target=probe_health, args=(srv.url, stop, health), daemon=True)
    prober.start()
    try:
        t0 = time.monotonic()
        half = open_connections(srv.port, args.half_sent, HALF_SENT)
        idle = open_connections(srv.port, args.idle, b"")
        opened_s = time.monotonic() - t0
        limit = max(args.header_timeout_s, args.body_timeout_s) + 20
        closes = watch_closes({"half-sent bodies": half, "idle connections": idle}, time.monotonic() + limit)
        stop.set()
        prober.join(10)
        alive_after = httpx.get(srv.url + "/health", timeout=5).status_code
    finally:
        stop.set()
        rc = srv.stop()
    print(
        f"opened {args.half_sent} half-sent bodies and {args.idle} idle connections in {opened_s:.1f} s "
        f"(server open-files limit {args.open_files})"
    )
    for name, c in closes.items():
        early = sum(t < min(args.header_timeout_s, args.body_timeout_s) - 0.5 for t in c["closes_s"])
        extra = (
            f", {c['answered_408']} answered 408 first"
            if name.startswith("half")
            else f", {early} of them at once (closed as the oldest idle at the connection cap)"
        )
        print(
            f"{name}: {c['closed']}/{c['opened']} closed by the server, the last after "
            f"{max(c['closes_s'], default=0):.1f} s{extra}"
        )
    print(summarize("/health during the flood", health))
    print_log(srv, lines_before, alive_after, rc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
