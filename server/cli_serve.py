"""`ridgefill serve`: flags, config file, logging, uvicorn.

Startup checks what it can before the slow parts, so an operator error is one line within a
second: the config (no torch import), then the listening socket (bound here, before the
model loads), then the device (imports torch only for cuda). A model that cannot load ends
the process with status 1; SIGTERM/SIGINT drain within server.shutdown_grace_s and exit 0.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket

from ridgefill_runtime.config import EngineConfig
from ridgefill_runtime.settings_file import add_flags, given_flags, operator_tables

from .config import ConfigError, ServerConfig, check_device, effective_config_text, load_config


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """`serve`'s flags: --config, then one per setting that declares a flag (the fields of
    EngineConfig and its nested configs, and ServerConfig)."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--config", default=None, help="operator TOML file (see examples/ridgefill.toml); flags override it")
    flags = flag_keys(p)
    p.set_defaults(handler=run_serve, flag_keys=flags)  # handler: what ridgefill_runtime.cli.main runs
    return p


def flag_keys(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Adds every setting's flag to `parser`; {argparse dest: dotted config key}."""
    keys = {}
    for cls, table in [*operator_tables(EngineConfig), (ServerConfig, "server")]:
        keys.update(add_flags(parser, cls, table))
    return keys


# flag dest -> dotted config key; a flag left at None does not override the file.
_FLAG_KEYS = flag_keys(argparse.ArgumentParser(add_help=False))


def run_serve(args: argparse.Namespace) -> int:
    engine_cfg, server_cfg, fill = load_config(args.config, given_flags(args, args.flag_keys))
    sock = _listen(server_cfg.host, server_cfg.port)
    try:
        check_device(engine_cfg)
        return _serve(sock, engine_cfg, server_cfg, fill)
    finally:
        sock.close()


def _listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a port in use or a bad host fails
    at once, naming the flag (uvicorn would find it only after the load)."""
    try:
        return _bind(host, port)
    except socket.gaierror as e:
        raise ConfigError(f"--host / server.host {host!r}: cannot resolve it ({e.strerror})") from None
    except OSError as e:
        flag = "--port / server.port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "--host / server.host"
        raise ConfigError(f"{flag}: cannot listen on {host}:{port} ({e.strerror})") from None


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # NOTE: as uvicorn: TIME_WAIT is no conflict
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _serve(sock: socket.socket, engine_cfg, server_cfg, fill) -> int:
    # NOTE: imported only now: torch (through the app) costs seconds; every check above is done.
    import torch

    from ridgefill_runtime.errors import ModelLoadError, ParallelError

    from .app import create_app
    from .connections import (
        DrainingServer,
        connection_cap,
        quiet_connection_errors,
        raise_open_files_limit,
        uvicorn_config,
    )

    logging.basicConfig(level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("ridgefill.server")
    if server_cfg.threads:
        torch.set_num_threads(server_cfg.threads)
    cap = connection_cap(server_cfg.max_connections, raise_open_files_limit())
    log.info(
        "effective config (torch threads: %d):\n%s",
        torch.get_num_threads(),
        effective_config_text(engine_cfg, server_cfg, fill),
    )
    failure: list[str] = []
    server: DrainingServer | None = None

    def fail(cause: str) -> None:
        failure.append(cause)
        server.should_exit = True  # NOTE: read by uvicorn's main loop every 0.1 s

    lost: list[str] = []

    def engine_lost(cause: str) -> None:
        lost.append(cause)
        server.should_exit = True

    app = create_app(engine_cfg, server_cfg, fill, on_load_failure=fail, on_engine_lost=engine_lost)
    config = uvicorn_config(app, server_cfg, cap, log_level=server_cfg.log_level)  # listens on `sock`
    state = app.state.ridgefill
    server = DrainingServer(config, on_signal=state.begin_shutdown, drained=state.finish_shutdown)
    quiet_connection_errors()
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    server.run(sockets=[sock])
    if failure:
        raise ModelLoadError(f"cannot load the model ({engine_cfg.model or 'embedded default'}): {failure[0]}")
    if lost:
        raise ParallelError(f"the engine stopped: {lost[0]}")
    return 0
