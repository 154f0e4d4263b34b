"""The operator config file (TOML) and the server's own frozen settings.

`load_config(path, overrides)` is the one place `serve` reads a setting: the file first, then
$RIDGEFILL_API_KEY, then CLI overrides on top (dotted keys such as "server.port"; None means
"not given"). An unknown key or a value of the wrong type stops startup with one error naming
the key and the file. Every key is a field of a config dataclass (EngineConfig and its nested
configs, ServerConfig here), declared once with `setting(...)` (ridgefill_runtime/settings_file.py,
which reads and checks the values). The engine's tables are read by
ridgefill_runtime/operator_config.py, as `ridgefill generate | score | eval --config` read them;
this module adds [server].
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# NOTE: nothing here may import torch at module level (ridgefill_runtime.fill.maps does): a
# bad flag or file must fail in well under a second, not after a 4-8 s torch import.
from ridgefill_runtime.config import EngineConfig
from ridgefill_runtime.errors import ConfigError
from ridgefill_runtime.fill.settings import FillSettings
from ridgefill_runtime.operator_config import ENGINE_SCHEMA, build_engine, check_device, gather
from ridgefill_runtime.settings_file import Key, check_settings, setting, table_keys

__all__ = ["ConfigError", "ServerConfig", "check_device", "effective_config_text", "load_config"]

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
    """The operator file's tables: the engine's (ridgefill_runtime/operator_config.py, which the
    runtime's commands read too) and [server]."""
    return {**ENGINE_SCHEMA, "server": table_keys(ServerConfig, "server")}


# section -> key -> Key (accepted types, the collected table the value goes to, its field)
_SCHEMA: dict[str, dict[str, Key]] = _sections()


def load_config(
    path: str | Path | None, overrides: dict[str, Any] | None = None
) -> tuple[EngineConfig, ServerConfig, FillSettings]:
    """Read the TOML file (optional) and apply CLI overrides; raises ConfigError."""
    # NOTE: $RIDGEFILL_API_KEY sits above the file, below the flags
    env = [("server.api_key", os.environ[API_KEY_ENV], f"${API_KEY_ENV}")] if API_KEY_ENV in os.environ else []
    gathered = gather(path, overrides, extra={"server": _SCHEMA["server"]}, between=env)
    _read_api_key_file(gathered.values["server"], gathered.origin)
    try:
        server = ServerConfig(**gathered.values["server"])
    except ValueError as e:
        raise ConfigError(f"{gathered.source}: {e}") from None
    engine, fill_settings = build_engine(gathered)
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


def effective_config_text(engine: EngineConfig, server: ServerConfig, fill: FillSettings) -> str:
    """One log line per section; the API key is never printed."""
    return "\n".join([f"engine: {asdict(engine)}", f"server: {server.redacted()}", f"fill: {asdict(fill)}"])
