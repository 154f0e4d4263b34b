"""Shared pieces of the server tests: the embedded model's engine and the real app over HTTP."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_server.app import create_app
from ridgefill_server.background import BackgroundServer
from ridgefill_server.config import load_config


def embedded_engine(tmp_path_factory, num_blocks: int, threads: int):
    """The embedded SmolLM2 engine with its GGUF conversion cached under the test's temp dir."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
        torch.set_num_threads(threads)
        return build_engine(EngineConfig(cache=CacheConfig(num_blocks=num_blocks)))


def app_server(build, **overrides) -> BackgroundServer:
    """The real app on a free loopback port, with server.* settings overridden by keyword."""
    engine_cfg, server_cfg, fill = load_config(None, {f"server.{k}": v for k, v in overrides.items()})
    return BackgroundServer(create_app(engine_cfg, server_cfg, fill, build=build))


def serve_embedded(tmp_path_factory, num_blocks: int = 256):
    """Yields the real app on the embedded engine (default settings, `num_blocks` KV blocks),
    ready, with the engine as its `engine` attribute: the body of a module-scoped fixture."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
        torch.set_num_threads(2)
        engine_cfg, server_cfg, fill = load_config(None, {"cache.num_blocks": num_blocks})
        engine = build_engine(engine_cfg)
        with BackgroundServer(create_app(engine_cfg, server_cfg, fill, build=lambda: engine)) as srv:
            srv.wait_ready()
            srv.engine = engine
            yield srv
