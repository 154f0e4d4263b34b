"""The GPU sources stay correct on 64-lane wavefronts (CDNA: gfx90a, gfx942; RDNA in wave64).

No AMD GPU is lent to these machines, so two checks stand in for running the kernels there:
scripts/check_wave_size.py reads csrc/ for wave32-only constructs (tested here against the real
sources and against mutants), and scripts/hip_check.py compiles the device code for the AMD
targets (the pieces that need no toolchain are tested here; the compile itself where clang-19 and
the device libraries of scripts/hip_check.sh are present, else skipped with the reason).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


lint = _load("check_wave_size")
hip_check = _load("hip_check")


def test_csrc_has_no_wave32_only_constructs():
    findings = lint.check_paths([CSRC])
    assert findings == [], "\n".join(map(str, findings))
    assert len(lint.gpu_sources([CSRC])) >= 10  # the .cu and .cuh files were read


# (what, file, text replaced, mutant text, rules that must fire)
MUTANTS = [
    (
        "full-mask shuffle in the attention block",
        "gqa_attention.cuh",
        "s[g] = warp_reduce_sum(part);",
        "s[g] = part + __shfl_xor_sync(0xffffffff, part, 16);",
        {"raw-intrinsic", "full-mask"},
    ),
    (
        "32-lane reduction written out in the GDN scan",
        "gdn_kernels.cuh",
        "kk = warp_reduce_sum(kk);",
        "for (int o = 16; o > 0; o /= 2) kk += __shfl_xor(kk, o);",
        {"raw-intrinsic"},
    ),
    (
        "lane index from a literal 32",
        "rms_norm_kernels.cuh",
        "const int64_t row = blockIdx.x;",
        "const int64_t row = blockIdx.x; const int lane = threadIdx.x % 32; (void)lane;",
        {"lane-literal"},
    ),
    (
        "warp index by a shift",
        "scattered_rows_attention_kernels.cuh",
        "const int row = blockIdx.x;",
        "const int row = blockIdx.x; const int w = threadIdx.x >> 5; (void)w;",
        {"lane-literal"},
    ),
    (
        "ballot with a 32-bit mask in common.cuh",
        "common.cuh",
        "// Integer ceil-division",
        "__device__ inline unsigned any_lane(bool p) { return __ballot_sync(0xFFFFFFFFu, p); }\n// Integer ceil-division",
        {"full-mask"},  # common.cuh may call intrinsics, never with a 32-lane mask
    ),
]


@pytest.mark.parametrize("what, file, old, new, rules", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_wave32_only_mutants_are_caught(tmp_path, what, file, old, new, rules):
    mutant = tmp_path / "csrc"
    shutil.copytree(CSRC, mutant)
    text = (mutant / file).read_text()
    assert old in text, f"{file} no longer contains {old!r}: update the mutant"
    (mutant / file).write_text(text.replace(old, new, 1))
    findings = lint.check_paths([mutant])
    assert {f.rule for f in findings} == rules, what
    assert all(f.path.name == file for f in findings)
    assert lint.main([str(mutant)]) == 1


def test_opt_out_comments_and_comment_text_are_not_code(tmp_path):
    src = tmp_path / "k.cuh"
    src.write_text(
        "// a 0xffffffff mask would be wrong here\n"
        "/* threadIdx.x % 32\n   __shfl_xor_sync(0xffffffff, v, 1) */\n"
        "int x = __shfl_xor_sync(0xffffffffu, v, 1);  // wave-size: NVIDIA-only branch\n"
        "int y = threadIdx.x % 32;\n"
    )
    findings = lint.check_paths([src])
    assert [(f.line, f.rule) for f in findings] == [(5, "lane-literal")]


def test_missing_path_is_one_clear_error(capsys):
    assert lint.main(["/nonexistent/csrc"]) == 2
    assert "no such file or folder: /nonexistent/csrc" in capsys.readouterr().err


def test_every_kernel_lives_in_a_device_header():
    """What hip_check compiles: each __global__ is in a torch-free header, none in a host .cu."""
    headers = hip_check.device_headers(CSRC)
    declared = {name for h in headers for name in hip_check.kernels_declared(h)}
    assert {"rms_norm_kernel", "gdn_scan_kernel", "int8_gemv_kernel", "int8_gemm_wmma_kernel"} <= declared
    for cu in CSRC.glob("*.cu"):
        assert "__global__" not in cu.read_text(), f"{cu.name} defines a kernel; move it to its _kernels.cuh"
    for h in headers:
        text = h.read_text()
        for torch_header in ("ATen/", "c10/cuda", "torch/"):
            assert torch_header not in text, f"{h.name} includes {torch_header}: device headers stay torch-free"


def _cuda_extension() -> Path | None:
    for so in sorted((ROOT / "ridgefill_runtime").glob("_C*.so")):
        if hip_check._STUB.search(os.popen(f"nm -C {so}").read()):
            return so
    return None


def test_cuda_instances_map_to_device_headers():
    so = _cuda_extension()
    if so is None:
        pytest.skip("the built extension has no CUDA kernels (no nvcc at install): nothing to list")
    instances = hip_check.cuda_instances(so)
    declared = {name for h in hip_check.device_headers(CSRC) for name in hip_check.kernels_declared(h)}
    assert instances and {i.name for i in instances} <= declared
    # every dtype the host dispatches is instantiated for the norm
    norm = sorted(i.template_args for i in instances if i.name == "rms_norm_kernel")
    assert norm == ["c10::BFloat16", "c10::Half", "float"]
    assert all(i.instantiation().startswith("template __global__ void ") for i in instances)


def _device_libs() -> Path | None:
    cache = Path(os.environ.get("RIDGEFILL_CACHE_DIR", Path.home() / ".cache" / "ridgefill"))
    libs = cache / "hip_check" / "rocm-device-libs-6.0"
    return libs if (libs / "oclc_isa_version_1201.bc").exists() else None


def test_rms_norm_compiles_for_wave64_and_wave32(tmp_path):
    so, libs = _cuda_extension(), _device_libs()
    if shutil.which(hip_check.CLANG) is None or libs is None or so is None:
        pytest.skip("needs clang++-19, the device libraries and a CUDA build: run bash scripts/hip_check.sh")
    header = CSRC / "rms_norm_kernels.cuh"
    instances = [i for i in hip_check.cuda_instances(so) if i.name == "rms_norm_kernel"]
    hip_src = hip_check.hipify(CSRC, tmp_path)
    for target, wave in (("gfx942", 64), ("gfx1201", 32), ("gfx1201-wave64", 64)):
        r = hip_check.compile_one(header, hip_src, hip_check.TARGETS[target], instances, libs, tmp_path)
        assert r.ok, r.log
        assert len(r.kernels) == 3 and {int(k["wavefront_size"]) for k in r.kernels} == {wave}
        # block_reduce_sum's scratch holds one float per warp of a 1024-thread block: kWarpSize
        # follows the target's wavefront size
        assert {int(k["group_segment_fixed_size"]) for k in r.kernels} == {1024 // wave * 4}
