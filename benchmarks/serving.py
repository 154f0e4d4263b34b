"""Start `ridgefill serve` in a subprocess for a benchmark and wait until /health answers 200."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _server_module(root: Path) -> str:
    """The module that runs the tree `root`'s server/. A tree from before server/ installed as
    ridgefill_server runs its bare `server` package, found through PYTHONPATH. `ridgefill_server`
    is found through the installed ridgefill only (the folder keeps its name), so another tree of
    the new layout would run the installed tree's server/ over its own runtime: refused."""
    if "ridgefill_server" not in (root / "pyproject.toml").read_text():
        return "server"
    spec = importlib.util.find_spec("ridgefill_server")
    found = Path(spec.submodule_search_locations[0]).resolve() if spec and spec.submodule_search_locations else None
    if found != (root / "server").resolve():
        raise RuntimeError(
            f"ridgefill_server resolves to {found}, not {root / 'server'}: install that tree to serve it"
        )
    return "ridgefill_server"


def start_server(serve_args: list[str], port: int, root: Path = ROOT) -> subprocess.Popen:
    """`python -m ridgefill_server serve <serve_args> --port port` from the tree `root` (another checkout
    runs a before/after comparison), healthy; its stderr tail if it dies first."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = [sys.executable, "-m", _server_module(root), "serve", *serve_args, "--port", str(port)]
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
