"""The operator config file (TOML) and the server's own frozen settings.

`load_config(path, overrides)` is the one place a setting is read: the file first, then CLI
overrides on top (dotted keys such as "server.port"; None means "not given"). An unknown key
or a value of the wrong type stops startup with one error naming the key and the file. Every
key is a field of a config dataclass (EngineConfig and its nested configs, ServerConfig here),
declared once with `setting(...)` (ridgefill_runtime/settings_file.py, which reads and checks
the values); the [fill] table's schema and defaults are the runtime's
(ridgefill_runtime/fill/settings.py), which `ridgefill generate/score --fill-config` read too.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# NOTE: nothing here may import torch at module level (ridgefill_runtime.fill.maps does): a
# bad flag or file must fail in well under a second, not after a 4-8 s torch import.
from ridgefill_runtime.config import EngineConfig, FillConfig
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
from ridgefill_runtime.settings_file import (
    Key,
    check_settings,
    checked_key,
    flatten,
    nested_tables,
    read_toml,
    renamed_keys,
    setting,
    store,
    table_keys,
)

API_KEY_ENV = "RIDGEFILL_API_KEY"  # read only by load_config, between the file and the flags
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's own settings: the operator file's [server] table."""

    host: str = setting("127.0.0.1", help="bind address: loopback unless you mean to expose the server", flag="--host")
    port: int = setting(8000, help="listening port", flag="--port")
    api_key: str | None = setting(
        None,
        help='when set, /v1/*, /tokenize and /metrics (see metrics_public) need "Authorization: Bearer <key>"; '
        "/health stays open; /docs, /redoc and /openapi.json are not served at all. Give it one way only: "
        "$RIDGEFILL_API_KEY (overrides api_key here; a flag overrides both), or a file. --api-key works too "
        "but shows in `ps`.",
        flag="--api-key",
        example='"change-me"',
    )
    api_key_file: str | None = setting(  # where api_key was read from (kept for the config log)
        None,
        help="a file holding the API key (whitespace around it is dropped)",
        flag="--api-key-file",
        example='"/run/secrets/ridgefill-key"',
    )
    metrics_public: bool = setting(  # with an api_key: False guards /metrics with the key too
        False, help="true: /metrics needs no key even when a key is set", flag="--metrics-public"
    )
    allowed_hosts: tuple[str, ...] | None = setting(  # None: see __post_init__
        None,
        help='Host header allow-list, others get 421 (DNS rebinding); "*" = any, "*.example.com" = its '
        "subdomains. Unset: the loopback names when host is loopback, else any",
        flag="--allowed-hosts",
        example='["localhost", "127.0.0.1", "::1"]',
    )
    served_model_name: str = setting(
        "ridgefill", help="the model name requests give and answers carry", flag="--served-model-name"
    )
    max_queued_requests: int = setting(
        64,
        help="requests waiting beyond the running ones; more get 503 + Retry-After",
        flag="--max-queued-requests",
        check="positive",
    )
    max_body_bytes: int = setting(
        4 * 2**20, help="larger request bodies get 413", flag="--max-body-bytes", check="positive"
    )
    retry_after_s: int = setting(1, help="the Retry-After value sent with 503", check="positive")
    default_chat_max_tokens: int = setting(
        1024,
        help="chat completions that give no max_tokens / max_completion_tokens",
        flag="--default-chat-max-tokens",
        check="positive",
    )
    max_stop_strings: int = setting(
        16, help="most stop strings one request may give (more get 400)", flag="--max-stop-strings", check=">= 0"
    )
    request_timeout_s: float = setting(
        600.0,
        help='cap on one request\'s duration (finish_reason "timeout"); a request\'s "timeout" field may only lower it',
        flag="--request-timeout-s",
        check="positive",
    )
    shutdown_grace_s: float = setting(
        30.0,
        help="SIGTERM/SIGINT: no new requests; running ones get this long, then are aborted and the process "
        "exits 0 (a second signal exits at once)",
        flag="--shutdown-grace-s",
        check="positive",
    )
    header_timeout_s: float = setting(
        10.0,
        help="a connection must send a whole request head within this, else it is closed",
        flag="--header-timeout-s",
        check="positive",
    )
    body_timeout_s: float = setting(
        30.0,
        help="each part of a request body must arrive within this, else 408",
        flag="--body-timeout-s",
        check="positive",
    )
    body_deadline_s: float = setting(
        60.0,
        help="a whole request body must arrive within this of its request head, else 408 (a body trickled a "
        "byte at a time never trips body_timeout_s)",
        flag="--body-deadline-s",
        check="positive",
    )
    keep_alive_s: float = setting(
        5.0, help="idle keep-alive connections are closed after this", flag="--keep-alive-s", check="positive"
    )
    rate_limit_per_minute: int = setting(
        0,
        help="generation requests (/v1/completions, /v1/chat/completions) per client address and minute, as a "
        "token bucket (a burst of that many, then one every 60/N s); more get 429 + Retry-After. 0: no limit",
        flag="--rate-limit-per-minute",
        check=">= 0",
        note="0: no limit",
    )
    max_connections: int = setting(
        1000,
        help="open connections; at the cap a new one closes the oldest idle or still-sending one (a body "
        "not yet whole); when every one is running a request, a few more are let in for /health only, the "
        "rest get 503. Lowered to fit the open-files limit, whose soft value is raised to the hard one at startup",
        flag="--max-connections",
        check="positive",
    )
    threads: int | None = setting(
        None, help="torch CPU threads; unset: torch's choice", flag="--threads", check="positive", example="2"
    )
    log_level: str = setting(
        "info",
        help="each request logs one ridgefill.access line (request id, status, duration, tokens)",
        flag="--log-level",
        choices=LOG_LEVELS,
    )

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port}")
        check_settings(self, "server")
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
        if not self.served_model_name:
            raise ValueError("server.served_model_name must not be empty")

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


def _sections() -> dict[str, dict[str, Key]]:
    """The operator file's tables, from the config dataclasses' fields: [model] (EngineConfig's
    own settings), a table per nested config of EngineConfig ([cache], [scheduler], ...; [fill]
    is the runtime's schema, FILL_KEYS, with its groups and [fill.rows] as dotted keys), [server]."""
    sections = {"model": table_keys(EngineConfig, "engine", nested=False)}
    for name, cls in nested_tables(EngineConfig):
        sections[name] = FILL_KEYS if cls is FillConfig else table_keys(cls, name)
    sections["server"] = table_keys(ServerConfig, "server")
    return sections


# section -> key -> Key (accepted types, the collected table the value goes to, its field)
_SCHEMA: dict[str, dict[str, Key]] = _sections()
_RENAMED = renamed_keys(EngineConfig, "model", nested=False)  # "model.model" -> "model.path"
# the tables a nested config dataclass is collected in: EngineConfig's field name for it
_NESTED = {name: cls for name, cls in nested_tables(EngineConfig) if cls is not FillConfig}


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> tuple[EngineConfig, ServerConfig, FillSettings]:
    """Read the TOML file (optional) and apply CLI overrides; raises ConfigError."""
    values: dict[str, dict[str, Any]] = {
        "engine": {},
        **{name: {} for name in _NESTED},
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
        nested = {name: cls(**values[name]) for name, cls in _NESTED.items()}
        engine = EngineConfig(fill=fill, **nested, **values["engine"])
        server = ServerConfig(**values["server"])
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if fill.enabled and "unigram" in values["rows"]:
        _check_unigram_file(fill.rows.unigram, origin.get("fill.rows.unigram", rows_origin(origin, source)))
    if fill.arm == "ridgefill":
        # NOTE: a recipe may have chosen the arm, and the shipped maps need no key at all
        where = origin.get("fill.maps") or origin.get("fill.mode") or origin.get("fill.recipe", source)
        _check_maps_header(fill, where)
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
    store(values, origin, checked_key(_SCHEMA, dotted, value, source, _RENAMED), dotted, value, source)


def effective_config_text(engine: EngineConfig, server: ServerConfig, fill: FillSettings) -> str:
    """One log line per section; the API key is never printed."""
    return "\n".join([f"engine: {asdict(engine)}", f"server: {server.redacted()}", f"fill: {asdict(fill)}"])
