"""Build script for the optional compiled kernels (`ridgefill_runtime._C`).

All metadata lives in pyproject.toml; this file only decides whether to build
the extension. Install with `pip install --no-build-isolation -e .` so the
extension compiles against the torch already in the environment (an isolated
build would fetch a fresh, huge torch, or none at all).

CUDA build: needs a CUDA build of torch and a toolkit (CUDA_HOME, or nvcc on
PATH as torch resolves it). No GPU is needed to compile. Targets come from
TORCH_CUDA_ARCH_LIST, default "8.0;9.0;12.0" (A100, H100/H200, RTX 50xx / RTX PRO
Blackwell; nvcc >= 12.8 knows sm_120, and the pinned toolkit is 13.0). Narrow it for a faster local
build, e.g. TORCH_CUDA_ARCH_LIST=9.0.

ROCm build: on a ROCm build of torch (torch.version.hip set) with ROCM_HOME,
the same CUDAExtension runs torch's hipify over csrc/ and compiles with hipcc;
the TORCH_LIBRARY_IMPL(..., CUDA, ...) registration serves HIP devices because
ROCm torch exposes them as "cuda". Pick GPU targets with PYTORCH_ROCM_ARCH,
e.g. `PYTORCH_ROCM_ARCH=gfx1201 pip install --no-build-isolation -e .` for an
RDNA4 card (wave32; csrc/common.cuh sizes warps accordingly).

CPU kernels (csrc/cpu/: the packed-weight GEMM, batched paged attention) build in
every case: with the CUDA sources above, or alone as a C++ extension on a CPU-only
torch, with no toolkit, or when RIDGEFILL_CPU_EXTENSION=1 (a fast local build).

Set RIDGEFILL_SKIP_EXTENSION=1 to install pure Python; everything then runs on
the torch reference implementations.
"""

from __future__ import annotations

import glob
import os

from setuptools import setup

EXT_NAME = "ridgefill_runtime._C"
ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0;12.0"


def _skip(reason: str) -> dict:
    print(f"ridgefill: skipping compiled extension {EXT_NAME} ({reason}); installing pure Python")
    # An editable install imports from the source tree, where an earlier
    # in-place build would still be picked up: remove it so "pure Python"
    # really is.
    for stale in glob.glob(os.path.join(ROOT, "ridgefill_runtime", "_C.*")):
        print(f"ridgefill: removing previously built {os.path.relpath(stale, ROOT)}")
        os.remove(stale)
    return {}


def _pip_cuda_include_dir(torch_cuda_version: str) -> str | None:
    """Header dir of the nvidia-* pip wheels matching torch's CUDA major.

    A toolkit installed only with the compiler (as on this project's GPU-less build machines) lacks
    the cuBLAS/cuSPARSE headers that torch's CUDA headers may include; the pip
    wheels torch depends on ship them. Only used when the toolkit lacks them,
    so a full toolkit never mixes header versions.
    """
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    major = torch_cuda_version.split(".")[0]
    for base in spec.submodule_search_locations:
        candidate = os.path.join(base, f"cu{major}", "include")
        if os.path.isfile(os.path.join(candidate, "cublas_v2.h")):
            return candidate
    return None


# -fopenmp: at::parallel_for is an inline OpenMP loop, serial without it. The CPU kernels pick
# their instruction set at run time (target attributes / target_clones with a portable default),
# so no -march flag is needed and one build runs on any x86-64.
CXX_FLAGS = ["-O3", "-fopenmp"]


def _cpu_sources() -> list[str]:
    return sorted(glob.glob(os.path.join("csrc", "*.cpp"))) + sorted(glob.glob(os.path.join("csrc", "cpu", "*.cpp")))


def _cpu_extension(reason: str) -> dict:
    """The schemas and CPU kernels alone (no GPU kernels)."""
    print(f"ridgefill: building CPU kernels only ({reason})")
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    extension = CppExtension(
        name=EXT_NAME,
        sources=_cpu_sources(),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": CXX_FLAGS},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


def _extension_kwargs() -> dict:
    """setup() arguments that add the extension, or {} to build pure Python."""
    if os.environ.get("RIDGEFILL_SKIP_EXTENSION") == "1":
        return _skip("RIDGEFILL_SKIP_EXTENSION=1")
    try:
        import torch
    except ImportError:
        return _skip("torch is not importable; install torch first and use --no-build-isolation")

    is_rocm = torch.version.hip is not None
    if os.environ.get("RIDGEFILL_CPU_EXTENSION") == "1":
        return _cpu_extension("RIDGEFILL_CPU_EXTENSION=1")
    if not is_rocm and torch.version.cuda is None:
        return _cpu_extension(f"torch {torch.__version__} is a CPU-only build")

    # Must be set before cpp_extension computes the -gencode flags (at build).
    if not is_rocm:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    # Ninja's default (cores + 2) oversubscribes small build machines.
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))

    from torch.utils.cpp_extension import CUDA_HOME, ROCM_HOME, BuildExtension, CUDAExtension

    include_dirs = [os.path.join(ROOT, "csrc")]
    nvcc_flags = ["-O3"]  # no --use_fast_math: rms_norm's numerics must match torch
    if is_rocm:
        if not ROCM_HOME:
            return _cpu_extension("ROCm torch but no ROCm installation found (set ROCM_HOME)")
    else:
        nvcc = os.path.join(CUDA_HOME or "", "bin", "nvcc")
        toolkit_include = os.path.join(CUDA_HOME or "", "include")
        if not CUDA_HOME or not os.path.isfile(nvcc):
            return _cpu_extension("no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")
        if not os.path.isfile(os.path.join(toolkit_include, "cuda_runtime.h")):
            return _skip(f"CUDA_HOME={CUDA_HOME} has no include/cuda_runtime.h; point CUDA_HOME at the toolkit root")
        if not os.path.isfile(os.path.join(toolkit_include, "cublas_v2.h")):
            pip_include = _pip_cuda_include_dir(torch.version.cuda)
            if pip_include:
                include_dirs.append(pip_include)
        # Compile the per-arch device code of one .cu file in parallel.
        nvcc_flags.append("--threads=2")

    sources = _cpu_sources() + sorted(glob.glob(os.path.join("csrc", "*.cu")))
    extension = CUDAExtension(
        name=EXT_NAME,
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": nvcc_flags},
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**_extension_kwargs())
