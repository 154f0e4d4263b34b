#!/usr/bin/env bash
# Issue 29's `ridgefill tune` runs, one after the other on a quiet machine (nothing else running),
# 2 threads. Each writes fill.toml, tune.json and frontier.png into its folder here.
#   gemma3-270m-16k  the setting for novel ΔNLL <= 0.02 with speed measured on a 16K prompt;
#                    maps for splits 14/16/17 fitted here on 32K tokens of the kernel-docs
#                    calibration; held out: 4 Python HOWTOs (never calibration text)
#   qwen2.5-coder-1.5b-4k  the 1.5B's speed/quality frontier at its shipped split (14), tails and
#                    the shipped row policy (special + lexical), speed on a 4K prompt; held out: 4 files of the standard
#                    library's email package (code; the maps were fitted on top-level modules)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=benchmarks/tune
HOWTO=/usr/share/doc/python3.11-doc/html/_sources/howto
STDLIB=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
uptime | tee "$OUT/load.txt"
if [[ -z "${ONLY:-}" || "$ONLY" == gemma ]]; then
    .venv/bin/ridgefill tune --model gemma3-270m --threads 2 \
        --heldout $HOWTO/regex.rst.txt $HOWTO/descriptor.rst.txt $HOWTO/functional.rst.txt $HOWTO/enum.rst.txt \
        --splits 14,16,17 --tails 1024 --rows lexical --max-novel-dnll 0.02 --length 16384 --reps 1 \
        --max-doc-tokens 4096 --calib-tokens 32000 --out "$OUT/gemma3-270m-16k" 2>&1 | tr '\r' '\n' \
        | grep -v '^$' | tee "$OUT/gemma3-270m-16k.log"
    uptime | tee -a "$OUT/load.txt"
fi
if [[ -z "${ONLY:-}" || "$ONLY" == qwen ]]; then
    .venv/bin/ridgefill tune --model qwen2.5-coder-1.5b --threads 2 \
        --heldout $STDLIB/email/_header_value_parser.py $STDLIB/email/message.py $STDLIB/email/utils.py \
        $STDLIB/email/feedparser.py \
        --splits 14 --tails 512,1024,2048 --rows lexical --max-novel-dnll 0.1 --length 4096 --reps 1 \
        --max-doc-tokens 3072 --out "$OUT/qwen2.5-coder-1.5b-4k" 2>&1 | tr '\r' '\n' \
        | grep -v '^$' | tee "$OUT/qwen2.5-coder-1.5b-4k.log"
    uptime | tee -a "$OUT/load.txt"
fi
