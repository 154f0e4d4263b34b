"""KV memory per sequence of each loop cache kind (seed 001 Table 2), from the runtime's own cache
spec for Huginn-0125's real config.json (parsed by the huginn_raven family), bf16, L = 1024, MB = 10^6
bytes, against Eq. (3) / (10); and the same for the looped demonstration model.

    .venv/bin/python benchmarks/loop_cache_memory.py
"""

from __future__ import annotations

import json

import torch

from ridgefill_runtime.config import LoopConfig
from ridgefill_runtime.loader.embedded import EMBEDDED
from ridgefill_runtime.models.huginn import HUGINN_RAVEN
from ridgefill_runtime.models.looped import loop_cache_spec

# Huginn-0125's config.json (tomg-group-umd/huginn-0125), the keys the family reads
HUGINN_0125 = {
    "model_type": "huginn_raven",
    "n_embd": 5280,
    "n_heads": 55,
    "num_key_value_heads": 55,
    "intermediate_size": 17920,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "mean_recurrence": 32,
    "vocab_size": 65536,
    "padded_vocab_size": 65536,
    "block_size": 4096,
    "rope_base": 50000,
    "norm_eps": 1e-6,
    "qk_bias": True,
    "bias": False,
    "tie_embeddings": True,
    "injection_type": "linear",
    "state_init": "like-init",
}
KINDS = (
    ("full", "full", 0),
    ("deepest plane", "deepest", 0),
    ("RIPE, W = 16", "ripe", 16),
    ("RIPE, W = 64", "ripe", 64),
    ("RIPE, W = 256", "ripe", 256),
)


def table(cfg, length: int) -> list[tuple[str, float, float]]:
    lc, b = cfg.family_config, 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16, per layer per token
    m_deep = b * length * (lc.prelude + lc.coda + lc.core)
    rows = []
    for name, kind, window in KINDS:
        spec = loop_cache_spec(cfg, LoopConfig(cache=kind, window=window, block=0), torch.bfloat16)
        measured = spec.kv_bytes_per_token() * length + spec.state_bytes_per_sequence()
        formula = {
            "full": b * length * (lc.prelude + lc.coda + lc.mean_recurrence * lc.core),
            "deepest": m_deep,
            "ripe": m_deep + b * lc.core * (lc.mean_recurrence - 1) * min(window, length),
        }[kind]
        rows.append((name, measured / 1e6, formula / 1e6))
    return rows


def main() -> None:
    huginn = HUGINN_RAVEN.config_from_hf(HUGINN_0125, {}, "Huginn-0125 config.json")
    demo_raw = json.loads((EMBEDDED["looped"] / "config.json").read_text())
    demo = HUGINN_RAVEN.config_from_hf(demo_raw, {}, "looped/config.json")
    for title, cfg in (("Huginn-0125", huginn), ("looped demonstration model", demo)):
        rows = table(cfg, 1024)
        full = rows[0][1]
        print(f"\n{title} (R = {cfg.family_config.mean_recurrence}), L = 1024, bf16")
        print("| cache | MB (runtime spec) | MB (Eq. 3 / 10) | of full |")
        print("|---|---|---|---|")
        for name, measured, formula in rows:
            print(f"| {name} | {measured:,.1f} | {formula:,.1f} | {measured / full:.1%} |")


if __name__ == "__main__":
    main()
