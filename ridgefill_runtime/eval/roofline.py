"""How close a measured time is to this machine's limits: the roofline column of the benchmarks.

A step that does F floating-point operations and moves B bytes cannot take less than
max(F / P, B / W) seconds, with P the machine's FMA peak and W its copy bandwidth. Both peaks are
measured here, on this machine, by a small C program (roofline_peaks.c) the benchmark compiles
and runs itself, so a table's fractions describe the CPU it was made on. "of roofline" is that
bound over the measured time: 1.00 would be at the limit.

Work counts (what the model must do, not what a kernel happens to do):
- decode step, B rows at context c: every linear weight read once (packed bytes as stored), the
  K/V of every row's context read once; 2 FLOPs per weight per row, plus attention's q·k and p·v;
- prefill of n rows: fill/ceiling.py's exact MACs (linear + causal attention) times 2, and the
  weights read once. The LM head's one row and the embedding are counted in decode only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path

import torch

from ..fill.ceiling import exact_macs, fill_macs, keys_read

_SOURCE = Path(__file__).with_name("roofline_peaks.c")


@dataclass(frozen=True)
class Peaks:
    fma_gflops: float  # all `threads` cores together
    copy_gbs: float
    lanes: int  # float32 lanes of the vector the FMA loop used
    threads: int

    def describe(self) -> str:
        return (
            f"peaks ({self.threads} threads, measured now): FMA {self.fma_gflops:.0f} GFLOP/s "
            f"({self.lanes}-lane vectors), copy {self.copy_gbs:.1f} GB/s"
        )


def _binary() -> Path:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("the roofline peaks need a C compiler with OpenMP (Debian: apt-get install gcc)")
    src = _SOURCE.read_bytes()
    key = hashlib.sha256(src + cc.encode()).hexdigest()[:16]
    out = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ridgefill" / "roofline" / key
    exe = out / "roofline_peaks"
    if not exe.exists():
        out.mkdir(parents=True, exist_ok=True)
        cmd = [cc, "-O3", "-march=native", "-fopenmp", str(_SOURCE), "-o", str(exe)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"compiling {_SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr}")
    return exe


def measure_peaks(threads: int) -> Peaks:
    done = subprocess.run([str(_binary()), str(threads)], capture_output=True, text=True, check=True)
    got = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    if int(got["threads_run"]) != threads:  # NOTE: the peak would be that of fewer cores than the benchmark's
        raise RuntimeError(
            f"the roofline peaks program ran on {got['threads_run']} threads, not the {threads} asked for "
            "(OMP_THREAD_LIMIT or OMP_DYNAMIC set?)"
        )
    return Peaks(float(got["fma_gflops"]), float(got["copy_gbs"]), int(got["lanes"]), threads)


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    def bound_s(self, peaks: Peaks) -> float:
        return max(self.flops / (peaks.fma_gflops * 1e9), self.bytes / (peaks.copy_gbs * 1e9))

    def columns(self, seconds: float, peaks: Peaks) -> dict:
        """GFLOP/s and GB/s achieved, each as a share of its peak, and the roofline fraction."""
        gflops, gbs = self.flops / seconds / 1e9, self.bytes / seconds / 1e9
        return {
            "gflops": gflops,
            "of_fma": gflops / peaks.fma_gflops,
            "gbs": gbs,
            "of_copy": gbs / peaks.copy_gbs,
            "of_roofline": self.bound_s(peaks) / seconds,
        }


def _nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if hasattr(w, "nbytes") and callable(w.nbytes):  # a PackedWeight
        return w.nbytes()
    return 0


def weight_bytes(weights) -> int:
    """Bytes a decode step reads of a weights dataclass: every tensor once (a tied LM head is the
    embedding: once), except an untied embedding table, of which a step reads one row per token."""
    seen: dict[int, int] = {}

    def walk(obj, name: str = "") -> None:
        if name == "embed" and getattr(weights, "lm_head", None) is not obj:
            return
        if is_dataclass(obj) and not isinstance(obj, type) and not hasattr(obj, "nbytes"):
            for f in fields(obj):
                walk(getattr(obj, f.name), f.name)
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, name)
        elif isinstance(obj, dict):
            for k, x in obj.items():
                walk(x, str(k))
        elif _nbytes(obj):
            seen[id(obj)] = _nbytes(obj)

    walk(weights)
    return sum(seen.values())


def linear_weights(layers, vocab: int, hidden: int) -> int:
    """Weights one row multiplies by: every layer's linear weights and the LM head."""
    return sum(layer.linear_macs() for layer in layers) + vocab * hidden


def decode_work(layers, vocab: int, hidden: int, wbytes: int, kv_elem_bytes: float, batch: int, context: int):
    """One decode step: `batch` rows, each at `context` positions; a sliding-window layer reads
    only its window's K/V."""
    keys = [keys_read(context - 1, context, layer.window) for layer in layers]  # one row's, per layer
    attn = sum(layer.attention_macs(context - 1, context) for layer in layers)
    kv = sum(2 * layer.kv_width * k for layer, k in zip(layers, keys)) * kv_elem_bytes
    flops = 2.0 * batch * (linear_weights(layers, vocab, hidden) + attn)
    return Work(flops, wbytes + batch * kv)


def prefill_work(layers, vocab: int, hidden: int, wbytes: int, n: int) -> Work:
    """Exact prefill of n rows, then the LM head on the last."""
    return Work(2.0 * (exact_macs(layers, n) + vocab * hidden), wbytes)


def fill_work(layers, vocab: int, hidden: int, wbytes: int, n: int, split: int, tail: int, chosen=()) -> Work:
    """The fill's prefill of n rows (fill/ceiling.py's count, `chosen` exact rows inside the
    filled region), then the LM head on the last."""
    return Work(2.0 * (fill_macs(layers, n, split, tail, tuple(chosen)) + vocab * hidden), wbytes)
