"""RidgeFill prefill speed on a mid-size random Qwen3.5-layout hybrid: exact vs filled TTFT through
the engine, one run, same threads, against the ceiling 1/r (seed 000 §2.5).

    python benchmarks/hybrid_fill_speed.py --threads 2 --lengths 4096 8192 --reps 2

The model is random (d = 1024, 24 layers, 3 Gated DeltaNet : 1 gated attention, float32, CPU):
speed does not depend on the weights' values, quality does, so no quality is measured here.
The maps are random too (int8, like fitted ones), and the terminal-state correction uses a
random ΔM: the same work as real ones. Reported per length: exact TTFT, fill TTFT without and
with the correction, their ratios, the ceiling 1/r with r = S/L + (1 - S/L)·T/N, and the second
sweep's state carry (the late GDN layers' update over the filled prefix rows, timed on its own
with the same functions) as a share of the fill's TTFT. transformers' own exact forward on the
same checkpoint is timed once per length as the peer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's engine TTFT timer
from prefill import time_ours as ttft  # noqa: E402

CONFIG = dict(
    model_type="qwen3_5_text",
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=4096,
    max_position_embeddings=16384,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    tie_word_embeddings=False,
)


def build_checkpoint(folder: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(CONFIG)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def random_maps(model, split: int, folder: Path) -> Path:
    """Int8 maps near the identity plus a ΔM per late GDN layer, in our map format."""
    from ridgefill_runtime.fill.maps import MapMeta, add_terminal_shift, save_maps

    cfg, hy = model.config, model.config.hybrid
    d, g = cfg.hidden_size, torch.Generator().manual_seed(1)
    late = range(split, cfg.num_layers)
    maps = {l: (torch.eye(d) + 0.01 * torch.randn(d, d, generator=g), torch.zeros(d)) for l in late}
    meta = MapMeta(
        model_identity=model.identity,
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        hidden_size=d,
        split=split,
        lam=0.03,
        calibration_rows=0,
        calibration_hash="random",
    )
    path = folder / f"maps-split{split}.safetensors"
    save_maps(path, meta, maps)
    shifts = {
        l: 1e-3 * torch.randn(hy.value_heads, hy.key_head_dim, hy.value_head_dim, generator=g)
        for l in late
        if hy.is_linear(l)
    }
    add_terminal_shift(path, shifts, every=2048, states=0)
    return path


def engine(model, fill, maps, n: int):
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.engine import Engine

    config = EngineConfig(
        cache=CacheConfig(kv_cache_gib=0.5),
        fill=fill,
        scheduler=SchedulerConfig(max_num_batched_tokens=n, max_num_seqs=1, chunk_size=n),
    )
    return Engine(model, None, config, maps)


@torch.inference_mode()
def carry_seconds(model, maps, ids: list[int], split: int, tail: int) -> float:
    """The second sweep's extra work on filled rows: per late GDN layer, x̂ from the map, the
    norm, in_proj, conv and scan over the n - tail prefix rows (their states only)."""
    from ridgefill_runtime.cache.spec import RecurrentCache
    from ridgefill_runtime.fill.capture import run_layer_inputs
    from ridgefill_runtime.layers.gated_deltanet import gdn_mixer, state_shapes
    from ridgefill_runtime.layers.zero_centred_norm import zero_centred_rms_norm
    from ridgefill_runtime.step_layout import SeqLayout, attention_batch

    cfg = model.config
    xs = {}
    run_layer_inputs(model, ids, lambda layer, h: xs.__setitem__(layer, h) if layer == split else None, upto=split)
    x_split = xs[split][: len(ids) - tail]
    m = x_split.shape[0]
    parts = RecurrentCache(state_shapes(cfg.hybrid), dtype=torch.float32).parts
    t = time.perf_counter()
    for layer in range(split, cfg.num_layers):
        if not cfg.hybrid.is_linear(layer):
            continue
        w = model.weights.layers[layer]
        state = {name: torch.zeros((1, *shape)) for name, shape in parts}
        batch = attention_batch([SeqLayout(rows=m, context_len=m, state_slot=0)], x_split.new_empty(0))
        xn = zero_centred_rms_norm(maps.predict(layer, x_split), w.input_norm, cfg.rms_norm_eps)
        gdn_mixer(
            xn, w.mixer, cfg.hybrid, batch, state, cfg.rms_norm_eps, out_rows=x_split.new_empty(0, dtype=torch.long)
        )
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--split", type=int, default=12)
    ap.add_argument("--tail", type=int, default=1024)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from ridgefill_runtime.config import FillConfig, RowsConfig
    from ridgefill_runtime.fill.maps import FillMaps
    from ridgefill_runtime.loader.hf import load_hf_folder
    from ridgefill_runtime.models.hybrid import HybridLM

    folder = Path(tempfile.mkdtemp(prefix="hybrid-bench-"))
    hf = build_checkpoint(folder)
    ckpt = load_hf_folder(folder)
    model = HybridLM(ckpt.config, ckpt.tensors)
    model.identity = ckpt.identity
    maps_path = random_maps(model, args.split, folder)
    maps = FillMaps(maps_path, "resident", model.dtype, model.device)
    rows = RowsConfig(selectors=("special",))
    fills = {
        "exact": FillConfig(),
        "fill": FillConfig(arm="ridgefill", split=args.split, tail=args.tail, maps=str(maps_path), rows=rows),
        "fill+corr": FillConfig(
            arm="ridgefill", split=args.split, tail=args.tail, maps=str(maps_path), rows=rows, terminal_state=True
        ),
    }
    ids_all = torch.randint(0, CONFIG["vocab_size"], (max(args.lengths),), generator=torch.Generator().manual_seed(2))
    ids_all = ids_all.tolist()
    layers = CONFIG["num_hidden_layers"]
    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} model=random qwen3_5_text d=1024 "
        f"L={layers} (18 GDN + 6 attention) float32 CPU; split={args.split} tail={args.tail}; median of {args.reps}"
    )
    print(
        f"{'tokens':>6} | {'hf exact s':>10} | {'exact s':>8} | {'fill s':>7} | {'fill+corr s':>11} | "
        f"{'speedup':>7} | {'+corr':>6} | {'ceiling':>7} | {'carry s':>7} | {'carry share':>11}"
    )
    print("-" * 104)
    for eng in (engine(model, f, maps, 256) for f in fills.values()):
        ttft(eng, ids_all[:256])  # warm up every path
    for n in args.lengths:
        ids = ids_all[:n]
        engines = {name: engine(model, f, maps, n) for name, f in fills.items()}
        times = {name: [] for name in fills}
        for _ in range(args.reps):
            for name, eng in engines.items():
                times[name].append(ttft(eng, ids))
        with torch.inference_mode():
            t = time.perf_counter()
            hf(torch.tensor([ids]), logits_to_keep=1, use_cache=True)
            hf_s = time.perf_counter() - t
        med = {name: statistics.median(v) for name, v in times.items()}
        carry = carry_seconds(model, maps, ids, args.split, args.tail)
        r = args.split / layers + (1 - args.split / layers) * args.tail / n
        print(
            f"{n:>6} | {hf_s:>10.1f} | {med['exact']:>8.1f} | {med['fill']:>7.1f} | {med['fill+corr']:>11.1f} | "
            f"{med['exact'] / med['fill']:>7.2f} | {med['exact'] / med['fill+corr']:>6.2f} | {1 / r:>7.2f} | "
            f"{carry:>7.1f} | {carry / med['fill']:>11.0%}"
        )


if __name__ == "__main__":
    main()
