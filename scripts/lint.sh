#!/usr/bin/env bash
# Lint, format and type checks, as CI runs them (needs `bash scripts/install.sh --test`, which
# installs the pinned ruff and mypy into .venv). Any finding exits non-zero.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
# Wave32-only constructs in the GPU sources (warp intrinsics outside common.cuh, 32-lane masks and
# lane indices): wrong on 64-lane AMD wavefronts, and no GPU here would show it.
.venv/bin/python scripts/check_wave_size.py
