"""Map files: per late layer l, x̂_l = A_l x_S + b_l, stored as int8 + bf16 scales + bf16 bias.

File: safetensors with `layers.{l}.qweight` int8 [d, d], `layers.{l}.scales` bf16 [d, G],
`layers.{l}.bias` bf16 [d], and string metadata naming the model, split and fit. A hybrid's
file may also hold the terminal-state correction: `terminal.{l}` float32 [Hv, Dk, Dv] per late
Gated DeltaNet layer (fill/terminal_state.py), fitted with these maps (metadata
`terminal_layers`, `terminal_every`, `terminal_states`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ModelLoadError
from .quant import dequantize_int8_groupwise, quantize_int8_groupwise

FORMAT = "ridgefill-maps"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class MapMeta:
    model_identity: str
    architecture: str
    num_layers: int
    hidden_size: int
    split: int
    lam: float
    calibration_rows: int
    calibration_hash: str

    def to_strings(self) -> dict[str, str]:
        d = {k: str(v) for k, v in self.__dict__.items()}
        d.update(format=FORMAT, format_version=str(FORMAT_VERSION))
        return d

    @classmethod
    def from_strings(cls, md: dict[str, str], where: str) -> MapMeta:
        if md.get("format") != FORMAT:
            raise ModelLoadError(f"{where}: not a ridgefill map file (format={md.get('format')!r})")
        if md.get("format_version") != str(FORMAT_VERSION):
            raise ModelLoadError(
                f"{where}: map format version {md.get('format_version')} is not the supported {FORMAT_VERSION}"
            )
        try:
            return cls(
                model_identity=md["model_identity"],
                architecture=md["architecture"],
                num_layers=int(md["num_layers"]),
                hidden_size=int(md["hidden_size"]),
                split=int(md["split"]),
                lam=float(md["lam"]),
                calibration_rows=int(md["calibration_rows"]),
                calibration_hash=md["calibration_hash"],
            )
        except KeyError as e:
            raise ModelLoadError(f"{where}: map metadata lacks {e.args[0]!r}") from None


def save_maps(path: str | Path, meta: MapMeta, maps: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """maps: late layer -> (A [d, d] float, b [d] float)."""
    tensors = {}
    for layer, (a, b) in sorted(maps.items()):
        q, s = quantize_int8_groupwise(a)
        tensors[f"layers.{layer}.qweight"] = q
        tensors[f"layers.{layer}.scales"] = s
        tensors[f"layers.{layer}.bias"] = b.to(torch.bfloat16).contiguous()
    md = meta.to_strings()
    md["layers"] = json.dumps(sorted(maps))
    save_file(tensors, str(path), metadata=md)


def add_terminal_shift(path: str | Path, shifts: dict[int, torch.Tensor], every: int, states: int) -> None:
    """Store ΔM per late GDN layer in the map file the maps came from (rewritten in place)."""
    with safe_open(str(path), framework="pt") as f:
        md = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("terminal.")}
    tensors.update({f"terminal.{layer}": t.float().contiguous() for layer, t in sorted(shifts.items())})
    md.update(terminal_layers=json.dumps(sorted(shifts)), terminal_every=str(every), terminal_states=str(states))
    save_file(tensors, str(path), metadata=md)


def check_maps_fit(meta: MapMeta, model_identity: str, config, split: int, where: str) -> None:
    """Refuse maps fitted for another model or split, naming what differs."""
    wants = {
        "model_identity": model_identity,
        "architecture": config.architecture,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "split": split,
    }
    for key, want in wants.items():
        have = getattr(meta, key)
        if have != want:
            raise ModelLoadError(
                f"{where}: maps do not fit this model: {key} is {have!r} in the map file, {want!r} for the model"
            )


class FillMaps:
    """Applies the maps. `resident`: dequantized once into device memory. `streamed`: int8 kept
    in (pinned) host memory and brought to the device per layer; the next layer's copy is
    started while the current one computes. Both dequantize with the same function, so
    their outputs are bitwise equal."""

    def __init__(self, path: str | Path, placement: str, dtype: torch.dtype, device: torch.device):
        where = str(path)
        if not Path(path).exists():
            raise ModelLoadError(f"{where}: map file not found")
        try:
            with safe_open(where, framework="pt") as f:
                self.meta = MapMeta.from_strings(f.metadata() or {}, where)
                self.layers: list[int] = json.loads(f.metadata()["layers"])
                raw = {k: f.get_tensor(k) for k in f.keys()}
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{where}: unreadable map file ({type(e).__name__}: {e})") from None
        self.placement, self.dtype, self.device = placement, dtype, device
        pin = placement == "streamed" and device.type == "cuda"
        self._host = {
            l: (
                raw[f"layers.{l}.qweight"].pin_memory() if pin else raw[f"layers.{l}.qweight"],
                raw[f"layers.{l}.scales"],
                raw[f"layers.{l}.bias"],
            )
            for l in self.layers
        }
        self.path = where
        self.terminal = {int(k.split(".")[1]): t.to(device) for k, t in raw.items() if k.startswith("terminal.")}
        self._resident: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if placement == "resident":
            self._resident = {l: self._materialize(l) for l in self.layers}
        self._prefetched: dict[int, tuple[tuple[torch.Tensor, torch.Tensor], object]] = {}
        self._gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x  # keep_outputs: a rank's all-gather

    def _materialize(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, s, b = self._host[layer]
        q = q.to(self.device, non_blocking=True)
        a = dequantize_int8_groupwise(q, s.to(self.device), self.dtype)  # [d, d]
        return a, b.to(device=self.device, dtype=self.dtype)

    def _weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.placement == "resident":
            return self._resident[layer]
        ready = self._prefetched.pop(layer, None)
        if ready is None:
            w = self._materialize(layer)
        else:
            w, event = ready
            torch.cuda.current_stream(self.device).wait_event(event)
            for t in w:
                t.record_stream(torch.cuda.current_stream(self.device))
        nxt = next((l for l in self.layers if l > layer), None)
        if nxt is not None and self.device.type == "cuda":
            # NOTE: on a side stream so the copy overlaps this layer's compute; the event
            # makes the next layer wait for it only when it needs the weights.
            stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(stream):
                nw = self._materialize(nxt)
                event = torch.cuda.Event()
                event.record(stream)
            self._prefetched[nxt] = (nw, event)
        return w

    def keep_value_heads(self, lo: int, hi: int) -> None:
        """A tensor-parallel rank's ΔM: its own value heads lo..hi only, as its Gated DeltaNet
        states hold (parallel/shard.py)."""
        self.terminal = {layer: t[lo:hi].contiguous() for layer, t in self.terminal.items()}

    def keep_outputs(self, lo: int, hi: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A tensor-parallel rank's maps: output columns lo..hi of every x̂ (rows of A and b; the
        int8 scales are per row, so the cut changes no value); `gather` joins the ranks' columns
        into the whole x̂ every rank needs (benchmarks/tensor_parallel_parts.py measured this
        against whole maps on every rank)."""
        self._host = {
            l: (q[lo:hi].contiguous(), s[lo:hi].contiguous(), b[lo:hi]) for l, (q, s, b) in self._host.items()
        }
        if self.placement == "resident":
            self._resident = {l: self._materialize(l) for l in self.layers}
        self._gather = gather

    def terminal_shift(self, layer: int) -> torch.Tensor:
        """ΔM [Hv, Dk, Dv] float32 of late recurrent layer `layer`."""
        return self.terminal[layer]

    def predict(self, layer: int, x_split: torch.Tensor) -> torch.Tensor:
        """x_S [F, d] -> x̂_layer [F, d]."""
        a, b = self._weights(layer)
        return self._gather(torch.nn.functional.linear(x_split, a, b))  # [F, d] (a rank's [F, d/n] joined)
