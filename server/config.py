"""The operator config file (TOML) and the server's own frozen settings.

`load_config(path, overrides)` is the one place a setting is read: the file first, then CLI
overrides on top (dotted keys such as "server.port"; None means "not given"). An unknown key
or a value of the wrong type stops startup with one error naming the key and the file. The
[fill] table's schema and defaults are the runtime's (ridgefill_runtime/fill/settings.py), which
`ridgefill generate/score --fill-config` read too; the reading and type checks are
ridgefill_runtime/settings_file.py.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# NOTE: nothing here may import torch at module level (ridgefill_runtime.fill.maps does): a
# bad flag or file must fail in well under a second, not after a 4-8 s torch import.
from ridgefill_runtime.config import (
    CacheConfig,
    EngineConfig,
    FillConfig,
    LoopConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from ridgefill_runtime.loader.embedded import model_path
from ridgefill_runtime.errors import ConfigError, ModelLoadError
from ridgefill_runtime.fill.settings import (
    FILL_KEYS,
    FillSettings,
    new_fill_values,
    put_fill_value,
    resolve_fill,
    rows_origin,
)
from ridgefill_runtime.settings_file import Key, checked_key, flatten, read_toml, store

API_KEY_ENV = "RIDGEFILL_API_KEY"  # read only by load_config, between the file and the flags
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None  # from server.api_key, $RIDGEFILL_API_KEY or the api_key_file
    api_key_file: str | None = None  # where api_key was read from (kept for the config log)
    served_model_name: str = "ridgefill"
    max_queued_requests: int = 64  # waiting beyond the running ones; more gets 503
    max_body_bytes: int = 4 * 2**20
    retry_after_s: int = 1
    threads: int | None = None  # torch CPU threads; None: torch's choice
    log_level: str = "info"
    default_chat_max_tokens: int = 1024  # chat completions that give no max_tokens
    max_stop_strings: int = 16  # most stop strings one request may give
    request_timeout_s: float = 600.0  # server-wide cap on one request; a request's `timeout` may lower it
    shutdown_grace_s: float = 30.0  # SIGTERM/SIGINT: finish running requests for this long, then abort
    header_timeout_s: float = 10.0  # a connection must send a whole request head within this
    body_timeout_s: float = 30.0  # each part of a request body must arrive within this, else 408
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 1000  # open connections; lowered to fit the open-files limit
    rate_limit_per_minute: int = 0  # generation requests per client address and minute; 0: no limit
    allowed_hosts: tuple[str, ...] | None = None  # Host header allow-list; None: see __post_init__
    metrics_public: bool = False  # with an api_key: False guards /metrics with the key too

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port}")
        for name in (
            "max_queued_requests",
            "max_body_bytes",
            "retry_after_s",
            "default_chat_max_tokens",
            "max_connections",
            "request_timeout_s",
            "shutdown_grace_s",
            "header_timeout_s",
            "body_timeout_s",
            "keep_alive_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"server.{name} must be positive, got {getattr(self, name)}")
        if self.rate_limit_per_minute < 0:
            raise ValueError(
                f"server.rate_limit_per_minute must be >= 0 (0: no limit), got {self.rate_limit_per_minute}"
            )
        if self.max_stop_strings < 0:
            raise ValueError(f"server.max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.api_key is not None and (
            not self.api_key or not self.api_key.isprintable() or not self.api_key.isascii() or " " in self.api_key
        ):
            raise ValueError("server.api_key must be non-empty printable ASCII without spaces")
        if self.allowed_hosts is None:
            # NOTE: a server on loopback answers only to loopback names, so a web page cannot
            # reach it through DNS rebinding (evil.example resolving to 127.0.0.1).
            hosts = LOOPBACK_NAMES + (self.host,) if is_loopback(self.host) else ("*",)
            object.__setattr__(self, "allowed_hosts", tuple(dict.fromkeys(hosts)))
        else:
            object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))
            if not self.allowed_hosts or not all(self.allowed_hosts):
                raise ValueError('server.allowed_hosts must list at least one host name ("*": any)')
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"server.threads must be positive, got {self.threads}")
        if not self.served_model_name:
            raise ValueError("server.served_model_name must not be empty")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(
                f"server.log_level must be one of critical/error/warning/info/debug, got {self.log_level!r}"
            )

    def redacted(self) -> dict:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# [server]: ServerConfig fields and their TOML types (allowed_hosts is a list of str).
_SERVER_TYPES: dict[str, tuple[type, ...]] = {
    "host": (str,),
    "port": (int,),
    "api_key": (str,),
    "api_key_file": (str,),
    "served_model_name": (str,),
    "max_queued_requests": (int,),
    "max_body_bytes": (int,),
    "retry_after_s": (int,),
    "threads": (int,),
    "log_level": (str,),
    "default_chat_max_tokens": (int,),
    "max_stop_strings": (int,),
    "request_timeout_s": (int, float),
    "shutdown_grace_s": (int, float),
    "header_timeout_s": (int, float),
    "body_timeout_s": (int, float),
    "keep_alive_s": (int, float),
    "max_connections": (int,),
    "rate_limit_per_minute": (int,),
    "allowed_hosts": (list,),
    "metrics_public": (bool,),
}

# section -> key -> Key (accepted types, the dataclass the value is passed to, its field).
# "engine", "cache", "scheduler", "speculative", "looped", "server" name that dataclass; [fill] is the runtime's schema
# (FILL_KEYS), whose nested tables flatten to dotted keys ("corrections.key_rescale", "rows.selectors").
_SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "path": Key((str,), "engine", "model"),
        "dtype": Key((str,), "engine", "dtype"),
        "weights": Key((str,), "engine", "weights"),
        "device": Key((str,), "engine", "device"),
        "cuda_graphs": Key((bool,), "engine", "cuda_graphs"),
    },
    "cache": {
        "block_size": Key((int,), "cache", "block_size"),
        "kv_cache_gib": Key((int, float), "cache", "kv_cache_gib"),
        "num_blocks": Key((int,), "cache", "num_blocks"),
        "prefix_caching": Key((str,), "cache", "prefix_caching"),
        "kv_dtype": Key((str,), "cache", "kv_dtype"),
    },
    "scheduler": {
        "max_num_batched_tokens": Key((int,), "scheduler", "max_num_batched_tokens"),
        "max_num_seqs": Key((int,), "scheduler", "max_num_seqs"),
        "chunk_size": Key((int,), "scheduler", "chunk_size"),
        "prefill_budget_with_decodes": Key((int,), "scheduler", "prefill_budget_with_decodes"),
    },
    "speculative": {
        name: Key(types, "speculative", name)
        for name, types in (("method", (str,)), ("num_tokens", (int,)), ("max_ngram", (int,)), ("min_ngram", (int,)))
    },
    "looped": {
        name: Key(types, "looped", name)
        for name, types in (
            ("loops", (int,)),
            ("cache", (str,)),
            ("window", (int,)),
            ("block", (int,)),
            ("draft_loops", (int,)),
            ("allow_short_window", (bool,)),
        )
    },
    "fill": FILL_KEYS,
    "server": {
        name: Key(types, "server", name, items=str if list in types else None) for name, types in _SERVER_TYPES.items()
    },
}


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> tuple[EngineConfig, ServerConfig, FillSettings]:
    """Read the TOML file (optional) and apply CLI overrides; raises ConfigError."""
    values: dict[str, dict[str, Any]] = {
        "engine": {},
        "cache": {},
        "scheduler": {},
        "speculative": {},
        "looped": {},
        **new_fill_values(),
        "server": {},
    }
    origin: dict[str, str] = {}  # dotted key -> where its value came from, for errors found later
    source = str(path) if path else "command line"
    if path:
        for dotted, value in flatten(read_toml(Path(path))):
            _put(values, origin, dotted, value, source)
    if API_KEY_ENV in os.environ:  # NOTE: above the file, below the flags
        _put(values, origin, "server.api_key", os.environ[API_KEY_ENV], f"${API_KEY_ENV}")
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _put(values, origin, dotted, value, "command line")
    _read_api_key_file(values["server"], origin)
    fill_settings, fill = resolve_fill(values, origin, model=values["engine"].get("model"), source=source)
    try:
        cache = CacheConfig(**values["cache"])
        scheduler = SchedulerConfig(**values["scheduler"])
        speculative = SpeculativeConfig(**values["speculative"])
        engine = EngineConfig(
            cache=cache,
            scheduler=scheduler,
            fill=fill,
            speculative=speculative,
            looped=LoopConfig(**values["looped"]),
            **values["engine"],
        )
        server = ServerConfig(**values["server"])
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if fill.enabled and "unigram" in values["rows"]:
        _check_unigram_file(fill.rows.unigram, origin.get("fill.rows.unigram", rows_origin(origin, source)))
    if fill.arm == "ridgefill":
        _check_maps_header(fill, origin.get("fill.maps", origin["fill.mode"]))
    _check_model_path(engine.model, origin)
    return engine, server, fill_settings


def _read_api_key_file(server: dict[str, Any], origin: dict[str, str]) -> None:
    """server.api_key_file -> server.api_key (the file holds the key; surrounding whitespace
    is dropped). Two sources of the key at once is an error, not a silent precedence."""
    path = server.get("api_key_file")
    if path is None:
        if server.get("api_key") == "":
            raise ConfigError(f"{origin['server.api_key']}: the API key is empty")
        return
    where = origin["server.api_key_file"]
    if "api_key" in server:
        raise ConfigError(
            f"{where}: key 'server.api_key_file' conflicts with the API key from "
            f"{origin['server.api_key']}; give only one of --api-key / ${API_KEY_ENV} / "
            f"server.api_key and --api-key-file / server.api_key_file"
        )
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigError(f"{where}: key 'server.api_key_file': {path} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: key 'server.api_key_file': cannot read {path} ({e})") from None
    if not key:
        raise ConfigError(f"{where}: key 'server.api_key_file': {path} is empty")
    server["api_key"] = key
    origin["server.api_key"] = where


def _check_model_path(model: str | None, origin: dict[str, str]) -> None:
    """A model path that does not exist is an operator error at startup, not a load failure
    found after the server has started."""
    if model is None:
        return
    try:
        found = model_path(model).exists()
    except ModelLoadError as e:  # a packaged model whose packages are missing or damaged
        raise ConfigError(f"{origin['model.path']}: key 'model.path': {e}") from None
    if not found:
        raise ConfigError(f"{origin['model.path']}: key 'model.path': {model} not found")


def check_device(engine: EngineConfig) -> None:
    """Refuse model.device = cuda[:N] on a machine without that GPU, naming the setting.
    Imports torch, so callers run it after the checks that do not need it."""
    device = engine.device
    if device == "cpu":
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"model.device (--device) {device!r}: must be cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"model.device (--device) {device!r}: no CUDA device is available "
            f'(torch.cuda.is_available() is false); use "cpu"'
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(
            f"model.device (--device) {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
        )


def _check_unigram_file(path: str, where: str) -> None:
    """A counts file that does not exist is refused at startup, not when the first request needs it."""
    if not Path(path).is_file():
        raise ConfigError(f"{where}: key 'fill.rows.unigram': counts file {path} not found")


def _check_maps_header(fill: FillConfig, where: str) -> None:
    """Refuse a missing, foreign or other-split map file before the server starts; the model
    itself is checked against the maps when it loads (llm.load_fill_maps)."""
    from ridgefill_runtime.fill.maps import MapMeta  # imports torch: only for mode = "plain"
    from safetensors import safe_open

    path = Path(fill.maps)
    if not path.is_file():
        raise ConfigError(f"{where}: key 'fill.maps': map file {path} not found")
    try:
        with safe_open(str(path), framework="pt") as f:  # reads the header only
            meta = MapMeta.from_strings(f.metadata() or {}, str(path))
    except ModelLoadError as e:
        raise ConfigError(f"{where}: key 'fill.maps': {e}") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConfigError(f"{where}: key 'fill.maps': {path}: unreadable map file ({type(e).__name__}: {e})") from None
    if meta.split != fill.split:
        raise ConfigError(
            f"{where}: key 'fill.maps': {path} holds maps fitted for split {meta.split}, but fill.split is {fill.split}"
        )


def _put(values: dict, origin: dict, dotted: str, value: Any, source: str) -> None:
    if dotted.partition(".")[0] == "fill":
        put_fill_value(values, origin, dotted, value, source)  # the runtime's [fill] schema
        return
    store(values, origin, checked_key(_SCHEMA, dotted, value, source), dotted, value, source)


def effective_config_text(engine: EngineConfig, server: ServerConfig, fill: FillSettings) -> str:
    """One log line per section; the API key is never printed."""
    return "\n".join([f"engine: {asdict(engine)}", f"server: {server.redacted()}", f"fill: {asdict(fill)}"])
