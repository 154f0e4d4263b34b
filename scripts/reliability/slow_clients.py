"""Slow and idle clients against a `serve` subprocess whose open-files limit is 1,024:
200 half-sent bodies (Content-Length 1000, 10 bytes sent) and 1,100 idle connections, while
/health is probed on fresh connections. Reports how many the server closed, how /health
fared, and what the server logged. Loopback only; ends by itself (about a minute).

    .venv/bin/python scripts/reliability/slow_clients.py [--half-sent 200 --idle 1100]
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--half-sent", type=int, default=200)
    p.add_argument("--idle", type=int, default=1100)
    p.add_argument("--open-files", type=int, default=1024, help="the server's open-files limit (soft and hard)")
    p.add_argument("--header-timeout-s", type=float, default=10)
    p.add_argument("--body-timeout-s", type=float, default=10)
    args = p.parse_args()
    raise_own_open_files()
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
    ok = sum(status == 200 for status, _ in health)
    print(
        f"/health during the flood: {ok}/{len(health)} answered 200, slowest {max((s for _, s in health), default=0):.2f} s; "
        f"others: {sorted({str(status) for status, _ in health if status != 200}) or 'none'}"
    )
    log = srv.non_access_lines(lines_before)
    access = len(srv.log) - lines_before - len(log)
    print(
        f"server log during the run: {access} access lines (one per request), {len(log)} other lines, "
        f"{sum('Traceback' in line for line in log)} tracebacks; /health after: {alive_after}; "
        f"exit status after SIGTERM: {rc}"
    )
    for line in log[:8]:
        print("  log:", line.rstrip()[:160])
    return 0


if __name__ == "__main__":
    sys.exit(main())
