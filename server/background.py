"""Run the real app under uvicorn in a background thread on a free loopback port.

For tests and benchmarks in one process: the caller can reach the Engine directly (e.g. to
watch KV blocks) while talking to the server over real HTTP.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from .connections import uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    def __init__(self, app, port: int | None = None):
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # NOTE: the same protocol, timeouts and connection cap as `ridgefill serve`.
        config = uvicorn_config(
            app,
            app.state.ridgefill.config,
            app.state.ridgefill.config.max_connections,
            log_level="warning",
            port=self.port,
        )
        self.connections = config.connection_guard
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        # NOTE: uvicorn exposes no awaitable "started" event across threads; its flag is the signal.
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll /health until 200: readiness is only observable over HTTP, like a real client."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.url}/health did not become ready in {timeout} s")
