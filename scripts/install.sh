#!/usr/bin/env bash
# Idempotent developer/CI install: .venv + torch + ridgefill (editable, with
# the compiled extension when a CUDA toolkit is present). Safe to re-run.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The CUDA build of torch. Its headers and libraries are what nvcc compiles and
# links the extension against, which works on a machine without a GPU; a CPU
# wheel would silently turn the build into pure Python. The extension is only
# ABI-compatible with the torch it was built against, so pin it in one place.
TORCH_VERSION="2.14.1"
VENV=".venv"

if [[ ! -x "$VENV/bin/python" ]]; then
    PYTHON_BIN="$(command -v python3.11 || command -v python3)"
    echo "install: creating $VENV with $PYTHON_BIN"
    "$PYTHON_BIN" -m venv "$VENV"
else
    echo "install: reusing $VENV ($("$VENV/bin/python" --version))"
fi
PIP=("$VENV/bin/python" -m pip)

echo "install: torch==$TORCH_VERSION, ninja, setuptools"
# setuptools>=64 is needed for editable installs without build isolation.
"${PIP[@]}" install -q "torch==$TORCH_VERSION" ninja "setuptools>=64" wheel

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"

# Editable builds compile in a fresh temp dir every time (~40 s on 2 cores),
# so skip the reinstall when the built extension still loads (same torch ABI)
# and nothing it or the metadata depends on changed since it was built.
so="$(ls ridgefill_runtime/_C.*.so 2>/dev/null | head -n 1 || true)"
if [[ "${RIDGEFILL_SKIP_EXTENSION:-0}" != "1" && -n "$so" ]] \
    && [[ -z "$(find csrc setup.py pyproject.toml -newer "$so" -print -quit)" ]] \
    && "$VENV/bin/python" -m pip show -q ridgefill >/dev/null 2>&1 \
    && "$VENV/bin/python" -c 'import ridgefill_runtime.ops as o, sys; sys.exit(0 if o.extension_loaded() else 1)' 2>/dev/null; then
    echo "install: ridgefill is installed and $so is up to date; not rebuilding"
else
    echo "install: ridgefill[test] (editable, no build isolation, CUDA_HOME=$CUDA_HOME)"
    start=$SECONDS
    # --no-build-isolation: build against the torch installed above instead
    # of a fresh download inside an isolated build environment.
    "${PIP[@]}" install -q --no-build-isolation -e '.[test]'
    echo "install: ridgefill installed in $((SECONDS - start))s"
fi

"$VENV/bin/python" - <<'PY'
import ridgefill_runtime.ops as ops
if ops.extension_loaded():
    print("install: compiled extension ridgefill_runtime._C: loaded")
else:
    print(f"install: compiled extension ridgefill_runtime._C: not loaded ({ops.extension_error()})")
PY
