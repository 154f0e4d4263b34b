"""Start `ridgefill serve` in a subprocess for a benchmark and wait until /health answers 200."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def start_server(serve_args: list[str], port: int, root: Path = ROOT) -> subprocess.Popen:
    """`python -m ridgefill_server serve <serve_args> --port port` from the tree `root` (another checkout runs
    a before/after comparison), healthy; its stderr tail if it dies first."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = [sys.executable, "-m", "ridgefill_server", "serve", *serve_args, "--port", str(port)]
    proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")
