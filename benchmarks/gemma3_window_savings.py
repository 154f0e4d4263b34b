"""What Gemma 3's sliding window could save in the cache and in the fill, from the model's own
config (counted, not timed): K/V rows held at a context length, and late-layer K/V rows the fill
writes for filled prefix rows, today vs a window-bounded cache.

    python benchmarks/gemma3_window_savings.py [--split 9 --tail 1024]

Today's cache keeps every position in every layer; the window bounds only what local layers read.
A window-bounded cache would keep, per local layer, the last `window` positions (plus the rows of
the step being computed); a fill that knew which rows later queries reach would write a filled
row's local-layer K/V only when an exact row lies less than `window` positions after it. Without
exact prefix rows that is the last window - 1 rows before the tail.
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", type=int, default=9)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 32768])
    args = ap.parse_args()
    from ridgefill_runtime.loader.load import load_checkpoint

    cfg = load_checkpoint("gemma3-270m").config
    w, local = cfg.family_config.window, set(cfg.family_config.local_layers)
    row_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32
    late = range(args.split, cfg.num_layers)
    late_local = [i for i in late if i in local]
    print(
        f"Gemma 3 270M: {cfg.num_layers} layers, {len(local)} local (window {w}), K/V {row_bytes} B per row "
        f"and layer (float32); split {args.split}, tail {args.tail}: {len(late)} late layers, "
        f"{len(late_local)} of them local\n"
    )
    print(
        "| context | K/V held today | window-bounded | held | fill K/V rows written today | reach-bounded | written |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.lengths:
        held = cfg.num_layers * n
        bounded = (cfg.num_layers - len(local)) * n + len(local) * min(n, w)
        filled = max(n - args.tail, 0)
        writes = len(late) * filled
        reach = (len(late) - len(late_local)) * filled + len(late_local) * min(filled, w - 1)
        mib = lambda rows: rows * row_bytes / 2**20  # noqa: E731
        print(
            f"| {n} | {mib(held):.0f} MiB | {mib(bounded):.0f} MiB | {bounded / held:.0%} | {writes} | {reach} | "
            f"{reach / writes:.0%} |"
        )


if __name__ == "__main__":
    main()
