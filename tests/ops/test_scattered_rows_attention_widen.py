"""Every instruction-set variant of the CPU attention kernel's row widening (float16 and int8 K/V read through an
fp32 copy, a group of keys per call: widen_rows in csrc/cpu/scattered_rows_attention_cpu.cpp).

An AVX-512 machine never picks the F16C / AVX2 or portable variants by itself; RIDGEFILL_CPU_ATTN_WIDEN caps the
pick (read when the extension loads, hence a fresh process per variant). The widening is exact in every variant
(float16 -> float32 is exact; an int8 value is float(q) * s, one rounded product), so the attention outputs must
be bitwise the same whichever variant ran, and within the float32 bound of an independent float64 computation.
The cases cover what the grouping changes: several KV heads per slot, K and V as strided views of one fused pool
(slot stride 2 * Hkv * D), a head dim with a scalar tail (40), short key groups and sliding windows.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_scattered_rows_attention_cpu import assert_mass_close, assert_out_close, make_cache, naive_f64
from test_scattered_rows_attention_int8 import int8_slabs

from ridgefill_runtime.cache import int8_kv
from ridgefill_runtime.ops import scattered_rows_attention
from ridgefill_runtime.ops.extension import op_available

CAP_ENV = "RIDGEFILL_CPU_ATTN_WIDEN"
needs_kernel = pytest.mark.skipif(
    not op_available("scattered_rows_attention_int8"), reason="compiled CPU extension not built"
)


def cases() -> dict[str, tuple]:
    """name -> (scattered_rows_attention's positional args, window, int8 scales or None)."""
    out = {}
    for head_dim, interleaved in ((64, False), (40, True)):
        lens = [1, 700, 33, 2049]
        k, v, tables, ctx = make_cache(lens, 3, head_dim, 16, torch.float16, seed=head_dim, interleaved=interleaved)
        rows = [(0, 0), (1, 699), (2, 32), (3, 2048), (3, 5), (3, 1000), (1, 2)] + [(2, p) for p in range(20, 33)]
        q_seq = torch.tensor([b for b, _ in rows], dtype=torch.int32)
        q_pos = torch.tensor([p for _, p in rows], dtype=torch.int64)
        q = torch.randn(len(rows), 9, head_dim, generator=torch.Generator().manual_seed(head_dim + 1))
        base = (q, q_seq, q_pos)
        for window in (0, 300):
            out[f"float16 d{head_dim} w{window}"] = ((*base, k, v, tables, ctx, 16, head_dim**-0.5), window, None)
            kq, vq, ks, vs = int8_slabs(k.float(), v.float())
            out[f"int8 d{head_dim} w{window}"] = ((*base, kq, vq, tables, ctx, 16, head_dim**-0.5), window, (ks, vs))
    return out


def run_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    results = {}
    for name, (args, window, scales) in cases().items():
        ks, vs = scales if scales is not None else (None, None)
        results[name] = scattered_rows_attention(*args, True, window, k_scale=ks, v_scale=vs)
    return results


_CHILD = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_scattered_rows_attention_widen import run_cases
torch.set_num_threads(2)
torch.save(run_cases(), sys.argv[2])
"""


@needs_kernel
@pytest.mark.parametrize("cap", ["avx2", "portable"])
def test_every_widening_variant_gives_the_same_bits(cap, tmp_path):
    got = {}
    for c in ("", cap):  # "": no cap, the variant this machine picks
        env = {k: v for k, v in os.environ.items() if k != CAP_ENV}
        if c:
            env[CAP_ENV] = c
        path = tmp_path / f"{c or 'picked'}.pt"
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, str(Path(__file__).parent), str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        got[c] = torch.load(path)
    for name, (args, window, scales) in cases().items():
        out, mass = got[cap][name]
        assert torch.equal(out, got[""][name][0]) and torch.equal(mass, got[""][name][1]), name
        q, q_seq, q_pos, k, v, tables = args[:6]
        if scales is not None:
            k, v = int8_kv.dequantize(k, scales[0]), int8_kv.dequantize(v, scales[1])
        exact_out, exact_mass = naive_f64(q, q_seq, q_pos, k, v, tables, 16, args[-1], window)
        assert_out_close(out, exact_out, torch.float32)
        if window == 0:  # naive_f64's mass covers every key of the row
            assert_mass_close(mass, exact_mass)
