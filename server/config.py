"""The operator config file (TOML) and the server's own frozen settings.

`load_config(path, overrides)` is the one place a setting is read: the file first, then CLI
overrides on top (dotted keys such as "server.port"; None means "not given"). An unknown key
or a value of the wrong type stops startup with one error naming the key and the file.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from ridgefill_runtime.errors import RidgefillError


class ConfigError(RidgefillError):
    """A config file or flag the server cannot start with; the message names key and source."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "ridgefill"
    max_queued_requests: int = 64  # waiting beyond the running ones; more gets 503
    max_body_bytes: int = 4 * 2**20
    retry_after_s: int = 1
    threads: int | None = None  # torch CPU threads; None: torch's choice
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port}")
        for name in ("max_queued_requests", "max_body_bytes", "retry_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"server.{name} must be positive, got {getattr(self, name)}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"server.threads must be positive, got {self.threads}")
        if not self.served_model_name:
            raise ValueError("server.served_model_name must not be empty")
        if self.log_level not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError(f"server.log_level must be one of critical/error/warning/info/debug, got {self.log_level!r}")

    def redacted(self) -> dict:
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d


FILL_NOT_AVAILABLE = "RidgeFill is not available yet in this build; only mode = \"off\" (exact prefill) is accepted"


@dataclass(frozen=True)
class FillSettings:
    """Placeholder until RidgeFill lands: only exact prefill ("off")."""

    mode: str = "off"

    def __post_init__(self) -> None:
        if self.mode != "off":
            raise ValueError(f"fill.mode {self.mode!r}: {FILL_NOT_AVAILABLE}")


# section -> key -> (accepted Python types, where it goes). "engine", "cache", "scheduler",
# "server", "fill" name the dataclass a value is passed to.
_SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], str, str]]] = {
    "model": {
        "path": ((str,), "engine", "model"),
        "dtype": ((str,), "engine", "dtype"),
        "device": ((str,), "engine", "device"),
    },
    "cache": {
        "block_size": ((int,), "cache", "block_size"),
        "kv_cache_gib": ((int, float), "cache", "kv_cache_gib"),
        "num_blocks": ((int,), "cache", "num_blocks"),
    },
    "scheduler": {
        "max_num_batched_tokens": ((int,), "scheduler", "max_num_batched_tokens"),
        "max_num_seqs": ((int,), "scheduler", "max_num_seqs"),
        "chunk_size": ((int,), "scheduler", "chunk_size"),
    },
    "fill": {
        "mode": ((str,), "fill", "mode"),
    },
    "server": {name: (types, "server", name) for name, types in {
        "host": (str,), "port": (int,), "api_key": (str,), "served_model_name": (str,),
        "max_queued_requests": (int,), "max_body_bytes": (int,), "retry_after_s": (int,),
        "threads": (int,), "log_level": (str,),
    }.items()},
}
# Keys that belong to the RidgeFill issue: named in the error so operators know why.
_FILL_LATER = ("split", "tail", "maps", "placement", "corrections")


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None
                ) -> tuple[EngineConfig, ServerConfig, FillSettings]:
    """Read the TOML file (optional) and apply CLI overrides; raises ConfigError."""
    values: dict[str, dict[str, Any]] = {"engine": {}, "cache": {}, "scheduler": {}, "fill": {}, "server": {}}
    source = str(path) if path else "command line"
    if path:
        for dotted, value in _flatten(_read_toml(Path(path))):
            _put(values, dotted, value, source)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _put(values, dotted, value, "command line")
    try:
        cache = CacheConfig(**values["cache"])
        scheduler = SchedulerConfig(**values["scheduler"])
        engine = EngineConfig(cache=cache, scheduler=scheduler, **values["engine"])
        server = ServerConfig(**values["server"])
        fill = FillSettings(**values["fill"])
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    return engine, server, fill


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from None


def _flatten(doc: dict) -> list[tuple[str, Any]]:
    out = []
    for section, body in doc.items():
        if not isinstance(body, dict):
            out.append((section, body))  # a top-level key: reported as unknown by _put
            continue
        out.extend((f"{section}.{key}", value) for key, value in body.items())
    return out


def _put(values: dict, dotted: str, value: Any, source: str) -> None:
    section, _, key = dotted.partition(".")
    spec = _SCHEMA.get(section, {}).get(key)
    if spec is None:
        if section == "fill" and key in _FILL_LATER:
            raise ConfigError(f"{source}: key '{dotted}': {FILL_NOT_AVAILABLE}")
        raise ConfigError(f"{source}: unknown key '{dotted}'")
    types, target, name = spec
    # NOTE: bool is an int subclass in Python; `port = true` must still be refused.
    if isinstance(value, bool) or not isinstance(value, types):
        want = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{source}: key '{dotted}' must be {want}, got {type(value).__name__} {value!r}")
    values[target][name] = float(value) if float in types else value


def effective_config_text(engine: EngineConfig, server: ServerConfig, fill: FillSettings) -> str:
    """One log line per section; the API key is never printed."""
    return "\n".join([f"engine: {asdict(engine)}", f"server: {server.redacted()}", f"fill: {asdict(fill)}"])
