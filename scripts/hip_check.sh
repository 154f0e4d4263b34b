#!/usr/bin/env bash
# Compile check of the extension's device code for AMD GPUs: gfx90a (MI200), gfx942 (MI300) and
# gfx1201 (R9700, in wave32 and in wave64), warnings as errors, on a machine with neither an AMD
# GPU nor a ROCm build of torch (scripts/hip_check.py says what it compiles and what it cannot).
#
# Toolchain, all from Debian's registry (about 1 minute on a fresh machine, ~300 MB):
#   clang-19, lld-19, llvm-19   bookworm: a HIP compiler with the gfx90a / gfx942 / gfx1201 targets
#   libamdhip64-dev             bookworm: the HIP headers (ROCm 5.2)
#   rocm-device-libs-17         trixie's ROCm 6.0 device libraries (LLVM 17 bitcode, which clang 19
#                               reads), downloaded and unpacked into the cache, not installed
# ROCm 6.0's device libraries predate gfx1201: their one per-target file it lacks, the ISA version
# constant, is written here from the gfx1100 one with the value 12001 (ROCm 7.0's own file for
# gfx1201 holds the same constant; its other bitcode is LLVM 21, which clang 19 cannot read).
#
# Without the toolchain and no way to install it (not root, no apt-get), the check is skipped
# with one line saying so and exits 0; HIP_CHECK_REQUIRED=1 makes that an error. Any build that
# fails, or a kernel whose wavefront size is not the target's, exits 1.
#   bash scripts/hip_check.sh [--self-test] [--targets gfx942,...] [--out FILE]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS

PACKAGES=(clang-19 lld-19 llvm-19 libamdhip64-dev)
DEVICE_LIBS_DEB="rocm-device-libs-17_6.0+git20231212.5a852ed-2_amd64.deb"
DEVICE_LIBS_URL="http://deb.debian.org/debian/pool/main/r/rocm-device-libs/$DEVICE_LIBS_DEB"
DEVICE_LIBS_SHA256="fa10f0f5be5269c715492e4e3d3816f956a4d8b9098443d54052d351cfda9213"
CACHE="${RIDGEFILL_CACHE_DIR:-$HOME/.cache/ridgefill}/hip_check"
PYTHON="${PYTHON:-.venv/bin/python}"

skip() {
    echo "hip_check: SKIPPED: $1"
    [[ "${HIP_CHECK_REQUIRED:-0}" == "1" ]] && exit 1
    exit 0
}

have_toolchain() {
    command -v clang++-19 >/dev/null && command -v llvm-readelf-19 >/dev/null \
        && command -v llvm-as-19 >/dev/null && [[ -f /usr/include/hip/hip_runtime.h ]]
}

if ! have_toolchain; then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
        skip "clang-19 / llvm-19 / the HIP headers are missing and cannot be installed here (needs root and apt-get): apt-get install ${PACKAGES[*]}"
    fi
    echo "hip_check: installing ${PACKAGES[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${PACKAGES[@]}" >/tmp/hip_check_apt.log 2>&1 \
        || { apt-get update >>/tmp/hip_check_apt.log 2>&1 \
            && apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>/tmp/hip_check_apt.log 2>&1; } \
        || skip "apt-get install ${PACKAGES[*]} failed (see /tmp/hip_check_apt.log)"
fi

libs="$CACHE/rocm-device-libs-6.0"
if [[ ! -f "$libs/oclc_isa_version_1201.bc" ]]; then
    echo "hip_check: fetching ROCm 6.0 device libraries ($DEVICE_LIBS_URL)"
    rm -rf "$CACHE/unpack" && mkdir -p "$CACHE/unpack" "$libs"
    curl -fsSL --retry 3 -o "$CACHE/$DEVICE_LIBS_DEB" "$DEVICE_LIBS_URL" \
        || skip "could not download $DEVICE_LIBS_URL"
    echo "$DEVICE_LIBS_SHA256  $CACHE/$DEVICE_LIBS_DEB" | sha256sum -c --quiet - \
        || { echo "hip_check: $DEVICE_LIBS_DEB does not match its pinned sha256" >&2; exit 1; }
    dpkg-deb -x "$CACHE/$DEVICE_LIBS_DEB" "$CACHE/unpack"
    cp "$CACHE"/unpack/usr/lib/llvm-17/lib/clang/17/amdgcn/bitcode/*.bc "$libs/"
    # gfx1201's ISA version constant, from the gfx1100 module (same data layout and linkage).
    llvm-dis-19 "$libs/oclc_isa_version_1100.bc" -o - \
        | sed 's/constant i32 11000,/constant i32 12001,/' \
        | llvm-as-19 -o "$libs/oclc_isa_version_1201.bc"
    llvm-dis-19 "$libs/oclc_isa_version_1201.bc" -o - | grep -q 'constant i32 12001,' \
        || { echo "hip_check: could not write oclc_isa_version_1201.bc" >&2; exit 1; }
    rm -rf "$CACHE/unpack"
fi
echo "hip_check: toolchain ready at $((SECONDS - start)) s"

[[ -x "$PYTHON" ]] || skip "no $PYTHON: run bash scripts/install.sh first"
"$PYTHON" scripts/check_wave_size.py
"$PYTHON" scripts/hip_check.py --device-libs "$libs" "$@"
echo "hip_check: finished in $((SECONDS - start)) s"
