#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the source that the llama-cpp-python sdist vendors
# (vendor/llama.cpp), so the side-by-side benchmark (benchmarks/llama_server_side_by_side.py)
# compares ridgefill against the very llama.cpp revision the tests already pin.
#
#   bash scripts/build_llama_server.sh            # builds once, prints the binary's path last
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 JOBS=2 RIDGEFILL_LLAMA_SERVER_CACHE=DIR bash scripts/...
#   LLAMA_SERVER_ISA=avx2 bash scripts/build_llama_server.sh  # AVX2 + FMA + F16C only, in DIR/<version>-avx2:
#                                                             # an AVX2 CPU's llama.cpp, on an AVX-512 machine
#
# Idempotent: when DIR/<version>/bin/llama-server exists, runs and was built with the same
# flags (DIR/<version>/FLAGS), nothing is rebuilt.
# Flags: Release, GGML_NATIVE=ON (this CPU's ISA), static libraries (one self-contained binary),
# only the llama-server target. The web UI: the server embeds a UI asset table generated at
# build time by scripts/ui-assets.cmake; it would come from a prebuilt dist/ tree, from
# `npm run build` (LLAMA_BUILD_UI, off by default) or from a Hugging Face download
# (LLAMA_USE_PREBUILT_UI, ON by default). Both are turned off here: the table is then empty and
# the server runs without its web page (the HTTP API, all the benchmark uses, is unaffected).
# LLAMA_CURL is deprecated in this revision (a warning, no effect); LLAMA_OPENSSL=OFF (no HTTPS
# client needed). OpenMP stays at llama.cpp's default (on when the compiler has it), as a user
# building llama-server would get it.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
CACHE_ROOT="${RIDGEFILL_LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ridgefill/llama-server}"
ISA="${LLAMA_SERVER_ISA:-native}"
[[ "$ISA" == "native" || "$ISA" == "avx2" ]] || { echo "build_llama_server: LLAMA_SERVER_ISA must be native or avx2, got $ISA" >&2; exit 2; }
ROOT="$CACHE_ROOT/$VERSION"
if [[ "$ISA" == "avx2" ]]; then ROOT="$ROOT-avx2"; fi
BIN_DIR="$ROOT/bin"
BIN="$BIN_DIR/llama-server"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

say() { echo "build_llama_server: $*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# AMX: with GGML_NATIVE on a CPU that has AMX (Sapphire Rapids and later), ggml compiles its AMX
# matmul path (tinygemm_kernel_amx). On the Xeon VM this was written on, that path dies with
# SIGILL at `tilezero` on the first decode although AMX itself works there (a small program
# that loads a tile config and zeroes a tile runs), so AMX is compiled out by default
# (-mno-amx-*; GCC keeps explicit -mno- flags over -march=native). LLAMA_SERVER_AMX=1 keeps it.
EXTRA_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && [[ "${LLAMA_SERVER_AMX:-0}" != "1" ]]; then
    EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
ISA_FLAGS="GGML_NATIVE=ON"
# NOTE: ggml's x86 ISA switches (used when GGML_NATIVE is off); AVX-VNNI and AVX512* stay off
if [[ "$ISA" == "avx2" ]]; then
    ISA_FLAGS="GGML_NATIVE=OFF GGML_AVX=ON GGML_AVX2=ON GGML_FMA=ON GGML_F16C=ON GGML_BMI2=ON GGML_AVX512=OFF"
fi
FLAGS="Release BUILD_SHARED_LIBS=OFF $ISA_FLAGS LLAMA_CURL=OFF LLAMA_OPENSSL=OFF LLAMA_BUILD_UI=OFF LLAMA_USE_PREBUILT_UI=OFF${EXTRA_FLAGS:+ C/CXX flags: $EXTRA_FLAGS}"

if [[ -x "$BIN" ]] && "$BIN" --version >/dev/null 2>&1 && [[ "$(cat "$ROOT/FLAGS" 2>/dev/null)" == "$FLAGS" ]]; then
    say "already built: $("$BIN" --version 2>&1 | grep -m1 -i version || true)"
    echo "$BIN"
    exit 0
fi

# -- tools -----------------------------------------------------------------------------------
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"; else PY="$(command -v python3 || true)"; fi
fi
[[ -n "$PY" ]] || die "no python3 (needed for pip download of the sdist); set PYTHON=/path/to/python"
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip"

CXX_BIN="${CXX:-$(command -v c++ || command -v g++ || true)}"
[[ -n "$CXX_BIN" ]] || die "no C++ compiler (Debian: apt-get install g++)"

CMAKE="$(command -v cmake || true)"
if [[ -z "$CMAKE" ]]; then
    # No system cmake: the pip one, into the venv the python belongs to.
    say "no cmake on PATH; installing it with pip into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install --quiet cmake || die "pip install cmake failed"
    CMAKE="$(dirname "$PY")/cmake"
    [[ -x "$CMAKE" ]] || CMAKE="$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))')"
fi
GEN=()
if command -v ninja >/dev/null; then GEN=(-G Ninja); fi

# -- source ----------------------------------------------------------------------------------
mkdir -p "$ROOT"
SDIST_DIR="$ROOT/sdist"
SRC="$ROOT/src/llama_cpp_python-$VERSION"
if [[ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]]; then
    mkdir -p "$SDIST_DIR"
    tarball="$(ls "$SDIST_DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)"
    if [[ -z "$tarball" ]]; then
        say "downloading the llama-cpp-python==$VERSION sdist with pip (76 MB)"
        "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SDIST_DIR" \
            || die "pip download of llama-cpp-python==$VERSION failed (needs access to PyPI or a pip cache)"
        tarball="$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
    fi
    [[ -f "$tarball" ]] || die "no sdist at $tarball"
    rm -rf "$ROOT/src"; mkdir -p "$ROOT/src"
    tar -xzf "$tarball" -C "$ROOT/src"
    [[ -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]] || die "the sdist has no vendor/llama.cpp (unexpected layout in $tarball)"
fi
LLAMA_SRC="$SRC/vendor/llama.cpp"

# -- build -----------------------------------------------------------------------------------
BUILD="$ROOT/build"
say "configuring $LLAMA_SRC (cmake $("$CMAKE" --version | head -1 | awk '{print $3}'), $JOBS jobs)"
start=$(date +%s)
"$CMAKE" -S "$LLAMA_SRC" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    $(for f in $ISA_FLAGS; do printf -- '-D%s ' "$f"; done) \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DCMAKE_C_FLAGS="$EXTRA_FLAGS" \
    -DCMAKE_CXX_FLAGS="$EXTRA_FLAGS" \
    >"$ROOT/configure.log" 2>&1 || die "cmake configure failed; see $ROOT/configure.log"
say "building llama-server (several minutes on 2 cores; log $ROOT/build.log)"
"$CMAKE" --build "$BUILD" --config Release --target llama-server -j "$JOBS" >"$ROOT/build.log" 2>&1 \
    || die "build failed; see $ROOT/build.log (last lines: $(tail -5 "$ROOT/build.log" | tr '\n' ' '))"
built="$(find "$BUILD" -type f -name llama-server -perm -u+x | head -1)"
[[ -n "$built" ]] || die "the build finished but no llama-server binary is in $BUILD"
mkdir -p "$BIN_DIR"
cp "$built" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
"$BIN" --version >/dev/null 2>&1 || die "$BIN does not run (--version failed)"
end=$(date +%s)
{
    echo "llama-cpp-python sdist: $VERSION"
    "$BIN" --version 2>&1 | head -3
    echo "built: $(date -u +%FT%TZ) in $((end - start)) s with $JOBS jobs; cmake $("$CMAKE" --version | head -1 | awk '{print $3}'); $("$CXX_BIN" --version | head -1)"
    echo "flags: $FLAGS"
} >"$ROOT/BUILD_INFO.txt"
echo "$FLAGS" >"$ROOT/FLAGS"
say "built in $((end - start)) s ($ROOT/BUILD_INFO.txt)"
echo "$BIN"
