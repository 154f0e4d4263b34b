#!/usr/bin/env bash
# Lint, format and type checks, as CI runs them (needs `bash scripts/install.sh --test`, which
# installs the pinned ruff and mypy into .venv). Any finding exits non-zero.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
