#!/usr/bin/env bash
# The Qwen2.5-Coder runs of issue 29's fidelity-by-size table (benchmarks/fidelity_by_size.py),
# with the same settings as SmolLM2's (benchmarks/fill_eval) and Gemma 3's (benchmarks/gemma3_eval):
# half depth, tail 1024, 4 documents of <= 4,500 tokens. Needles: 2 per task at 2,048 (SmolLM2's and
# Gemma's runs had 3 per task at 2,048 and 2,560; fewer here to fit the session's time).
# Quality runs do not depend on load; the speed runs need a quiet machine (nothing else running).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=benchmarks/fidelity_by_size
for spec in qwen2.5-coder-0.5b:12 qwen2.5-coder-1.5b:14; do
    model=${spec%:*} split=${spec#*:}
    [[ -n "${ONLY:-}" && "$ONLY" != "$model" ]] && continue
    .venv/bin/ridgefill eval --model "$model" --threads 2 --tail 1024 --docs 4 --max-doc-tokens 4500 \
        --split "$split" --arms nofill,identity,ridgefill --no-splices \
        --needles-per-task 2 --needle-lengths 2048 --out "$OUT/$model-split$split"
    .venv/bin/python benchmarks/code_completion.py --threads 2 --model "$model" --split "$split" --tail 1024 \
        --lengths 4096 --prompts-per-length 4 --arms nofill,ridgefill --out "benchmarks/code_completion/$model"
done
