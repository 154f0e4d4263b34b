#!/usr/bin/env bash
# The Gemma 3 270M evaluation of issue 17, one run each, 2 threads, in this order (CLAIM.md was
# written before it ran). Results land beside this file; SmolLM2's are in benchmarks/fill_eval/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=benchmarks/gemma3_eval
RF=(.venv/bin/ridgefill eval --model gemma3-270m --threads 2 --tail 1024 --docs 4 --max-doc-tokens 4500)
"${RF[@]}" --split 9 --needles-per-task 3 --needle-lengths 2048,2560 --out $OUT/split9
"${RF[@]}" --split 7 --needles-per-task 3 --needle-lengths 2048,2560 --no-splices --out $OUT/split7
"${RF[@]}" --split 9 --arms ridgefill --key-rescale --needles-per-task 1 --needle-lengths 2048 --no-splices --out $OUT/split9_key_rescale
"${RF[@]}" --split 9 --arms ridgefill --value-rescale --needles-per-task 1 --needle-lengths 2048 --no-splices --out $OUT/split9_value_rescale
.venv/bin/python -m ridgefill_runtime.eval.rows_eval --model gemma3-270m --split 9 --tail 1024 --threads 2 \
    --arms plain,lexical,lexical/random --per-task 4 --lengths 2048,3072,4096 --docs 4 --out $OUT/rows_split9
.venv/bin/python -c "from pathlib import Path; from ridgefill_runtime.eval.rows_eval import report; \
print(report(Path('$OUT/rows_split9'), 'plain,lexical,lexical/random'))"
.venv/bin/python benchmarks/fill_speed.py --threads 2 --model gemma3-270m --split 9 --lengths 4096 8192 --reps 2 \
    | tee $OUT/fill_speed_split9.txt
