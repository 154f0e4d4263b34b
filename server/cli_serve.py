"""`ridgefill serve`: flags, config file, logging, uvicorn."""

from __future__ import annotations

import argparse
import logging

from .config import effective_config_text, load_config

# flag dest -> dotted config key; a flag left at None does not override the file.
_FLAG_KEYS = {
    "model": "model.path", "dtype": "model.dtype", "device": "model.device",
    "block_size": "cache.block_size", "kv_cache_gib": "cache.kv_cache_gib", "num_blocks": "cache.num_blocks",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens", "max_num_seqs": "scheduler.max_num_seqs",
    "chunk_size": "scheduler.chunk_size", "fill": "fill.mode", "fill_split": "fill.split",
    "fill_tail": "fill.tail", "fill_maps": "fill.maps", "fill_placement": "fill.placement",
    "fill_selectors": "fill.rows.selectors",
    "host": "server.host", "port": "server.port", "api_key": "server.api_key",
    "served_model_name": "server.served_model_name", "max_queued_requests": "server.max_queued_requests",
    "max_body_bytes": "server.max_body_bytes", "threads": "server.threads", "log_level": "server.log_level",
}


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--config", default=None, help="operator TOML file (see examples/ridgefill.toml); flags override it")
    p.add_argument("--model", help="HF checkpoint folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-cache-gib", type=float)
    p.add_argument("--num-blocks", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    p.add_argument("--max-num-seqs", type=int, help="most sequences running at once")
    p.add_argument("--chunk-size", type=int, help="most prompt rows one sequence gets per step")
    p.add_argument("--fill", choices=["off", "plain"],
                   help="prefill mode: off = exact, plain = RidgeFill with the configured maps")
    p.add_argument("--fill-split", type=int, help="first late layer S (layers below it run exactly for every row)")
    p.add_argument("--fill-tail", type=int, help="last prompt rows always run through every layer")
    p.add_argument("--fill-maps", help="map file from `ridgefill fit` (default: the shipped maps of the embedded model)")
    p.add_argument("--fill-placement", choices=["resident", "streamed"], help="where the maps live")
    p.add_argument("--fill-selectors", type=_comma_list, metavar="A,B,C",
                   help="exact prefix row selectors, e.g. special,probe,lexical (sets fill.rows.selectors; "
                        "the other fill.rows keys take their defaults unless the config file gives them)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1 routes and /tokenize")
    p.add_argument("--served-model-name")
    p.add_argument("--max-queued-requests", type=int, help="queued beyond the running ones; more get 503")
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from .app import create_app

    overrides = {key: getattr(args, dest, None) for dest, key in _FLAG_KEYS.items()}
    engine_cfg, server_cfg, fill = load_config(args.config, overrides)
    logging.basicConfig(level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if server_cfg.threads:
        torch.set_num_threads(server_cfg.threads)
    log = logging.getLogger("ridgefill.server")
    log.info("effective config (torch threads: %d):\n%s", torch.get_num_threads(),
             effective_config_text(engine_cfg, server_cfg, fill))
    app = create_app(engine_cfg, server_cfg, fill)
    uvicorn.run(app, host=server_cfg.host, port=server_cfg.port, log_level=server_cfg.log_level)
    return 0
