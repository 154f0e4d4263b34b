"""A `python -m ridgefill_server serve` subprocess on the embedded model, for the reliability scripts:
loopback only, single-threaded unless told otherwise, small; stopped by the script that
started it. Also the client pieces they share: streamed completions that can be cut, and
/metrics readings."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_own_open_files() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


class Server:
    def __init__(self, *args: str, open_files: int | None = None, ready_timeout: float = 300):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        limit = None
        if open_files is not None:

            def limit():  # the child's open-files limit, soft and hard, as the tester's machine had
                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ridgefill_server",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--threads",
                "1",
                *args,
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            preexec_fn=limit,
            env={**os.environ, "RIDGEFILL_CACHE_DIR": os.environ.get("RIDGEFILL_CACHE_DIR", "/tmp/ridgefill-cache")},
        )
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        if not self._wait_ready(ready_timeout):
            self.stop()
            raise RuntimeError("server did not become ready:\n" + "".join(self.log[-20:]))

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return False

    def non_access_lines(self, since: int = 0) -> list[str]:
        return [line for line in self.log[since:] if "ridgefill.access" not in line]

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        time.sleep(0.2)  # let the log reader take the last lines
        return self.proc.returncode


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def idle_state(url: str) -> tuple[float, float, float]:
    """(KV usage ratio, running, waiting) as /metrics reports them now."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return (
        metric(text, "ridgefill_kv_cache_usage_ratio"),
        metric(text, "ridgefill_num_requests_running"),
        metric(text, "ridgefill_num_requests_waiting"),
    )


def wait_idle(url: str, timeout: float) -> float | None:
    """Seconds until the server reports an empty KV pool and no sequence; None if not in time."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if idle_state(url) == (0.0, 0.0, 0.0):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


async def stream_text(client: httpx.AsyncClient, body: dict, cut_after: int | None = None) -> str | None:
    """Stream a completion; with `cut_after`, close the connection after that many chunks
    (returns None then). Returns the whole text otherwise."""
    parts: list[str] = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            parts.append(json.loads(line[6:])["choices"][0]["text"])
            if cut_after is not None and len(parts) >= cut_after:
                return None  # leaving the block closes the connection mid-stream
    return "".join(parts)


def run(coro):
    return asyncio.run(coro)


@contextmanager
def serve(*args: str, ready_timeout: float = 300):
    """A Server for a `with` block: SIGTERM (then SIGKILL) when the block ends."""
    srv = Server(*args, ready_timeout=ready_timeout)
    try:
        yield srv
    finally:
        srv.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
