"""The operator config file (TOML) and the server's own frozen settings.

`load_config(path, overrides)` is the one place a setting is read: the file first, then CLI
overrides on top (dotted keys such as "server.port"; None means "not given"). An unknown key
or a value of the wrong type stops startup with one error naming the key and the file.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# NOTE: nothing here may import torch at module level (ridgefill_runtime.fill.maps does): a
# bad flag or file must fail in well under a second, not after a 4-8 s torch import.
from ridgefill_runtime.config import SELECTORS, CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.errors import ModelLoadError, RidgefillError
from ridgefill_runtime.fill.settings import NEEDS_COUNTS, needs_counts, shipped_maps, shipped_rows, shipped_unigram

API_KEY_ENV = "RIDGEFILL_API_KEY"  # read only by load_config, between the file and the flags
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class ConfigError(RidgefillError):
    """A config file or flag the server cannot start with; the message names key and source."""


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
    allowed_hosts: tuple[str, ...] | None = None  # Host header allow-list; None: see __post_init__
    metrics_public: bool = False  # with an api_key: False guards /metrics with the key too

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port}")
        for name in ("max_queued_requests", "max_body_bytes", "retry_after_s", "default_chat_max_tokens",
                     "max_connections", "request_timeout_s", "shutdown_grace_s", "header_timeout_s",
                     "body_timeout_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"server.{name} must be positive, got {getattr(self, name)}")
        if self.max_stop_strings < 0:
            raise ValueError(f"server.max_stop_strings must be >= 0, got {self.max_stop_strings}")
        if self.api_key is not None and (not self.api_key or not self.api_key.isprintable()
                                         or not self.api_key.isascii() or " " in self.api_key):
            raise ValueError("server.api_key must be non-empty printable ASCII without spaces")
        if self.allowed_hosts is None:
            # NOTE: a server on loopback answers only to loopback names, so a web page cannot
            # reach it through DNS rebinding (evil.example resolving to 127.0.0.1).
            hosts = LOOPBACK_NAMES + (self.host,) if is_loopback(self.host) else ("*",)
            object.__setattr__(self, "allowed_hosts", tuple(dict.fromkeys(hosts)))
        else:
            object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))
            if not self.allowed_hosts or not all(self.allowed_hosts):
                raise ValueError("server.allowed_hosts must list at least one host name (\"*\": any)")
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


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Operator names for the prefill: "plain" is RidgeFill with the configured maps; "nofill" and
# "identity" are the paper's ablation arms, accepted for evaluation runs.
FILL_MODES = {"off": "exact", "plain": "ridgefill", "nofill": "nofill", "identity": "identity"}
CORRECTIONS = ("value_rescale", "key_rescale")  # the boolean corrections a list may name


@dataclass(frozen=True)
class FillSettings:
    """The operator's fill mode; everything else about the fill lives in EngineConfig.fill."""

    mode: str = "off"

    def __post_init__(self) -> None:
        if self.mode not in FILL_MODES:
            raise ValueError(f"fill.mode must be one of {', '.join(FILL_MODES)}, got {self.mode!r}")

    @property
    def arm(self) -> str:
        return FILL_MODES[self.mode]


# [fill.rows]: every RowsConfig field (a list holds the element type named in _LIST_ITEMS);
# tests/server/test_server_fill.py checks that no field is missing.
_ROWS_TYPES: dict[str, tuple[type, ...]] = {
    "selectors": (list,), "attention_share": (int, float), "attention_layers": (list,), "window": (int,),
    "probe_window": (int,), "budget_factor": (int, float), "base_attention_share": (int, float),
    "protected_share": (int, float), "lexical_cap": (int, float), "lexical_sentence_rows": (int,),
    "unigram": (str,), "control": (str,), "seed": (int,),
}
_LIST_ITEMS = {"fill.rows.selectors": str, "fill.rows.attention_layers": int, "server.allowed_hosts": str}

# section -> key -> (accepted Python types, where it goes, field name). "engine", "cache",
# "scheduler", "server" name the dataclass a value is passed to; "fill" collects FillConfig
# fields plus "mode" (FillSettings); "rows" collects RowsConfig fields ([fill.rows]). Nested
# tables flatten to dotted keys ("corrections.key_rescale", "rows.selectors").
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
        "split": ((int,), "fill", "split"),
        "tail": ((int,), "fill", "tail"),
        "maps": ((str,), "fill", "maps"),
        "placement": ((str,), "fill", "placement"),
        # `corrections = ["value_rescale"]` (a list of names to switch on) or a table:
        "corrections": ((list,), "fill", "corrections"),
        "corrections.value_rescale": ((bool,), "fill", "value_rescale"),
        "corrections.key_rescale": ((bool,), "fill", "key_rescale"),
        "corrections.rescale_rows": ((int,), "fill", "rescale_rows"),
        **{f"rows.{name}": (types, "rows", name) for name, types in _ROWS_TYPES.items()},
    },
    "server": {name: (types, "server", name) for name, types in {
        "host": (str,), "port": (int,), "api_key": (str,), "api_key_file": (str,), "served_model_name": (str,),
        "max_queued_requests": (int,), "max_body_bytes": (int,), "retry_after_s": (int,),
        "threads": (int,), "log_level": (str,), "default_chat_max_tokens": (int,), "max_stop_strings": (int,),
        "request_timeout_s": (int, float), "shutdown_grace_s": (int, float), "header_timeout_s": (int, float),
        "body_timeout_s": (int, float), "keep_alive_s": (int, float), "max_connections": (int,),
        "allowed_hosts": (list,), "metrics_public": (bool,),
    }.items()},
}


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None
                ) -> tuple[EngineConfig, ServerConfig, FillSettings]:
    """Read the TOML file (optional) and apply CLI overrides; raises ConfigError."""
    values: dict[str, dict[str, Any]] = {"engine": {}, "cache": {}, "scheduler": {}, "fill": {}, "rows": {},
                                         "server": {}}
    origin: dict[str, str] = {}  # dotted key -> where its value came from, for errors found later
    source = str(path) if path else "command line"
    if path:
        for dotted, value in _flatten(_read_toml(Path(path))):
            _put(values, origin, dotted, value, source)
    if API_KEY_ENV in os.environ:  # NOTE: above the file, below the flags
        _put(values, origin, "server.api_key", os.environ[API_KEY_ENV], f"${API_KEY_ENV}")
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _put(values, origin, dotted, value, "command line")
    _read_api_key_file(values["server"], origin)
    try:
        fill_settings = FillSettings(values["fill"].pop("mode", "off"))
    except ValueError as e:
        raise ConfigError(f"{origin['fill.mode']}: {e}") from None
    fill_kwargs = {"arm": fill_settings.arm, **values["fill"]}
    if fill_settings.arm == "ridgefill":
        fill_kwargs["maps"] = _maps_path(values["engine"].get("model"), fill_kwargs, origin)
    rows = _rows(values["engine"].get("model"), fill_settings, values["rows"], origin, source)
    try:
        cache = CacheConfig(**values["cache"])
        scheduler = SchedulerConfig(**values["scheduler"])
        fill = FillConfig(rows=rows, **fill_kwargs)
        engine = EngineConfig(cache=cache, scheduler=scheduler, fill=fill, **values["engine"])
        server = ServerConfig(**values["server"])
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
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
        raise ConfigError(f"{where}: key 'server.api_key_file' conflicts with the API key from "
                          f"{origin['server.api_key']}; give only one of --api-key / ${API_KEY_ENV} / "
                          f"server.api_key and --api-key-file / server.api_key_file")
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
    if model is not None and not Path(model).exists():
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
        raise ConfigError(f"model.device (--device) {device!r}: no CUDA device is available "
                          f"(torch.cuda.is_available() is false); use \"cpu\"")
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"model.device (--device) {device!r}: only {torch.cuda.device_count()} "
                          f"CUDA device(s) are visible")


def _maps_path(model: str | None, fill_kwargs: dict, origin: dict[str, str]) -> str:
    """The map file for mode = "plain": the configured one, else the maps shipped for the
    embedded default model (they fit no other model, so a model path needs its own maps)."""
    if fill_kwargs.get("maps"):
        return fill_kwargs["maps"]
    if model is not None:
        raise ConfigError(f"{origin['fill.mode']}: key 'fill.maps' is required when fill.mode = \"plain\" "
                          f"and model.path is set (the shipped maps fit only the embedded default model)")
    return str(shipped_maps(fill_kwargs.get("split", FillConfig().split)))


def _rows(model: str | None, fill: FillSettings, given: dict[str, Any], origin: dict[str, str],
          source: str) -> RowsConfig:
    """The exact-row selection: the [fill.rows] keys given (others take RowsConfig's defaults),
    else SHIPPED_ROWS when fill.mode = "plain". With the fill on and no fill.rows.unigram, the
    embedded default model gets the shipped counts; another model must name its own when a
    selector reads them."""
    rows = dict(given) if given else (shipped_rows() if fill.mode == "plain" else {})
    where = next((origin[k] for k in origin if k.startswith("fill.rows.")), origin.get("fill.mode", source))
    try:
        config = RowsConfig(**rows)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if fill.arm == "exact":
        return config
    if config.unigram is None:
        wanted = needs_counts(config.selectors)
        if model is None:
            return config.replace(unigram=str(shipped_unigram()))
        if wanted:
            raise ConfigError(
                f"{where}: key 'fill.rows.unigram' is required when fill.rows.selectors include "
                f"{' or '.join(wanted)} and model.path is set (the shipped counts fit only the embedded "
                f"default model; or choose selectors without {' or '.join(NEEDS_COUNTS)})")
    elif not Path(config.unigram).is_file():
        raise ConfigError(f"{origin.get('fill.rows.unigram', where)}: key 'fill.rows.unigram': "
                          f"counts file {config.unigram} not found")
    return config


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
        raise ConfigError(f"{where}: key 'fill.maps': {path} holds maps fitted for split {meta.split}, "
                          f"but fill.split is {fill.split}")


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: cannot read config: not UTF-8 text (byte {e.object[e.start]:#04x} "
                          f"at offset {e.start})") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: cannot read config: {e}") from None


def _flatten(doc: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested tables become dotted keys; a top-level scalar stays bare (reported as unknown)."""
    out = []
    for key, body in doc.items():
        dotted = f"{prefix}{key}"
        if isinstance(body, dict):
            out.extend(_flatten(body, dotted + "."))
        else:
            out.append((dotted, body))
    return out


def _put(values: dict, origin: dict, dotted: str, value: Any, source: str) -> None:
    section, _, key = dotted.partition(".")
    spec = _SCHEMA.get(section, {}).get(key)
    if spec is None:
        if any(known.startswith(key + ".") for known in _SCHEMA.get(section, {})):
            raise ConfigError(f"{source}: key '{dotted}' must be a table ([{dotted}]), got {type(value).__name__}")
        raise ConfigError(f"{source}: unknown key '{dotted}'")
    types, target, name = spec
    # NOTE: bool is an int subclass in Python; `port = true` must still be refused.
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        if dotted == "fill.corrections":
            want = "list or table"
        elif dotted in _LIST_ITEMS:
            want = f"a list of {_LIST_ITEMS[dotted].__name__}"
        else:
            want = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{source}: key '{dotted}' must be {want}, got {type(value).__name__} {value!r}")
    if dotted in _LIST_ITEMS:
        item_type = _LIST_ITEMS[dotted]
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, item_type)]
        if bad:
            raise ConfigError(f"{source}: key '{dotted}' must be a list of {item_type.__name__}, "
                              f"got {type(bad[0]).__name__} {bad[0]!r} in it")
    if dotted == "fill.rows.selectors":
        for item in value:
            if item not in SELECTORS:
                raise ConfigError(f"{source}: key 'fill.rows.selectors': unknown selector {item!r} "
                                  f"(known: {', '.join(SELECTORS)})")
    if dotted == "fill.corrections":
        for item in value:
            if item not in CORRECTIONS:
                raise ConfigError(f"{source}: key 'fill.corrections': unknown correction {item!r} "
                                  f"(known: {', '.join(CORRECTIONS)}; rescale_rows needs the table form)")
            values["fill"][item] = True
            origin[f"fill.{item}"] = source
        return
    values[target][name] = float(value) if float in types else value
    origin[dotted] = source


def effective_config_text(engine: EngineConfig, server: ServerConfig, fill: FillSettings) -> str:
    """One log line per section; the API key is never printed."""
    return "\n".join([f"engine: {asdict(engine)}", f"server: {server.redacted()}", f"fill: {asdict(fill)}"])
