"""Compiles the extension's device code for AMD GPUs, without a ROCm build of torch or an AMD GPU.

What it does (scripts/hip_check.sh installs the toolchain and calls it):
  1. torch's hipify translates csrc/ into a scratch folder, as a ROCm build of torch would;
  2. the kernel instances to build are the ones the CUDA build launches, read from the built
     extension's symbols (ridgefill_runtime/_C*.so), so the list cannot drift from the host code;
  3. for every device-side header (csrc/*_kernels.cuh, *_wmma.cuh) and every target, one
     translation unit instantiates those kernels and clang compiles it for the device only, with
     -Wall -Wextra -Werror, to a code object;
  4. each code object's metadata is read back: every expected kernel is there, with the target's
     wavefront size, and its registers, LDS and scratch are reported.

The host side (bindings, launch checks, stream handling in csrc/*.cu) includes torch's ROCm-only
headers (c10/hip/*, ATen/hip/*), which exist only in a ROCm build of torch: it is not compiled
here. Usage: python scripts/hip_check.py --device-libs DIR [--targets ...] [--self-test].
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CLANG = os.environ.get("HIP_CHECK_CLANG", "clang++-19")
READELF = os.environ.get("HIP_CHECK_READELF", "llvm-readelf-19")
LDS_BYTES = 64 * 1024  # per workgroup on gfx90a, gfx942 and gfx1201


@dataclass(frozen=True)
class Target:
    name: str
    arch: str
    wave: int
    flags: tuple[str, ...] = ()


TARGETS = {
    t.name: t
    for t in (
        Target("gfx90a", "gfx90a", 64),  # MI200 (CDNA2)
        Target("gfx942", "gfx942", 64),  # MI300 (CDNA3)
        Target("gfx1201", "gfx1201", 32),  # R9700 / RX 9070 (RDNA4), default wave32
        Target("gfx1201-wave64", "gfx1201", 64, ("-mwavefrontsize64",)),  # RDNA4 built for wave64
    )
}


@dataclass(frozen=True)
class Instance:
    name: str  # kernel name, e.g. rms_norm_kernel
    template_args: str  # e.g. "c10::Half"
    params: str  # demangled parameter list, namespace-local

    def instantiation(self) -> str:
        return f"template __global__ void {self.name}<{self.template_args}>({self.params});"


@dataclass
class Result:
    header: str
    target: str
    ok: bool
    seconds: float = 0.0
    log: str = ""
    kernels: list[dict[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


# -- 1. hipify ----------------------------------------------------------------------------------


def hipify(src: Path, work: Path) -> Path:
    """csrc translated by torch's hipify into work/csrc; returns that folder."""
    from torch.utils.hipify import hipify_python

    out = work / "csrc"
    shutil.copytree(src, out)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its banner
        hipify_python.hipify(
            project_directory=str(work),
            output_directory=str(work),
            includes=[str(out / "*")],
            header_include_dirs=[str(out)],
            is_pytorch_extension=True,
            show_detailed=False,
            show_progress=False,
        )
    return out


# -- 2. the instances the CUDA build launches -----------------------------------------------------

_STUB = re.compile(r"__device_stub_(_Z\w+)\(")
_KERNEL = re.compile(r"^void ridgefill::\(anonymous namespace\)::(\w+)<(.*)>\((.*)\)$")


def cuda_instances(extension: Path) -> list[Instance]:
    """Every kernel instance the CUDA extension holds, from its device-stub symbols."""
    nm = subprocess.run(["nm", "-C", str(extension)], capture_output=True, text=True, check=True).stdout
    mangled = sorted(set(_STUB.findall(nm)))
    if not mangled:
        raise SystemExit(
            f"hip_check: {extension} holds no CUDA kernels (built without nvcc?); the kernel list "
            "comes from the CUDA build: run bash scripts/install.sh with nvcc on PATH first"
        )
    names = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True, check=True)
    instances = []
    for line in names.stdout.splitlines():
        m = _KERNEL.match(line.strip())
        if m is None:
            raise SystemExit(f"hip_check: cannot read the kernel symbol {line!r}")
        local = "ridgefill::(anonymous namespace)::"
        instances.append(Instance(m.group(1), m.group(2).replace(local, ""), m.group(3).replace(local, "")))
    return instances


def kernels_declared(header: Path) -> set[str]:
    """Names of the __global__ functions a header defines."""
    text = header.read_text()
    # __global__ void [__launch_bounds__(...) or a macro(...)] name(
    bounds = r"(?:\w+\s*\((?:[^()]|\([^()]*\))*\)\s*)?"
    return set(re.findall(r"__global__\s+void\s+" + bounds + r"(\w+)\s*\(", text))


def device_headers(src: Path) -> list[Path]:
    return sorted([*src.glob("*_kernels.cuh"), *src.glob("*_wmma.cuh")])


# -- 3. compile ---------------------------------------------------------------------------------


def translation_unit(hip_header: str, instances: list[Instance]) -> str:
    lines = [
        "// Generated by scripts/hip_check.py: every instance the CUDA build launches.",
        "#include <hip/hip_runtime.h>",
        f'#include "{hip_header}"',
        "namespace ridgefill {",
        "namespace {",
        *(i.instantiation() for i in instances),
        "}  // namespace",
        "}  // namespace ridgefill",
        "",
    ]
    return "\n".join(lines)


def clang_command(target: Target, tu: Path, out: Path, device_libs: Path, includes: list[Path]) -> list[str]:
    import torch.utils.cpp_extension as ce

    torch_includes = ce.include_paths()
    return [
        CLANG,
        "-x",
        "hip",
        "-std=c++17",
        "-O3",
        f"--offload-arch={target.arch}",
        *target.flags,
        "--cuda-device-only",
        "--no-gpu-bundle-output",
        "-c",
        "--rocm-path=/usr",
        f"--rocm-device-lib-path={device_libs}",
        # What torch's ROCm extension builds define (torch/utils/cpp_extension.py COMMON_HIP_FLAGS).
        "-D__HIP_PLATFORM_AMD__=1",
        "-DUSE_ROCM=1",
        "-D__HIP_NO_HALF_OPERATORS__=1",
        "-D__HIP_NO_HALF_CONVERSIONS__=1",
        "-Wall",
        "-Wextra",
        "-Werror",
        *(f"-I{p}" for p in includes),
        *(f"-isystem{p}" for p in torch_includes),
        "-o",
        str(out),
        str(tu),
    ]


_KERNEL_START = re.compile(r"^  - \.")
_KERNEL_KEY = re.compile(r"^    \.(\w+):\s+(\S+)")


def code_object_kernels(code_object: Path) -> list[dict[str, str]]:
    """Kernel-level metadata (name, wavefront_size, vgpr_count, ...) of an AMDGPU code object."""
    notes = subprocess.run([READELF, "--notes", str(code_object)], capture_output=True, text=True, check=True)
    kernels: list[dict[str, str]] = []
    in_kernels = False
    for line in notes.stdout.splitlines():
        if line.startswith("amdhsa.kernels:"):
            in_kernels = True
            continue
        if in_kernels and line and not line.startswith(" "):
            in_kernels = False
        if not in_kernels:
            continue
        if _KERNEL_START.match(line):
            kernels.append({})
            line = "    " + line[4:]
        m = _KERNEL_KEY.match(line)
        if m and kernels:
            kernels[-1][m.group(1)] = m.group(2)
    return kernels


def compile_one(
    header: Path, hip_src: Path, target: Target, instances: list[Instance], device_libs: Path, work: Path
) -> Result:
    hip_header = header.name.replace(".cuh", "_hip.cuh")
    stem = f"{header.stem}.{target.name}"
    tu = work / f"{stem}.hip"
    tu.write_text(translation_unit(hip_header, instances))
    out = work / f"{stem}.co"
    cmd = clang_command(target, tu, out, device_libs, [hip_src])
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    result = Result(header.name, target.name, run.returncode == 0, time.perf_counter() - start, run.stderr)
    if not result.ok:
        result.problems.append("compile failed")
        return result
    result.kernels = code_object_kernels(out)
    want = {f"{i.name}<{i.template_args}>" for i in instances}
    if len(result.kernels) != len(want):
        result.problems.append(f"{len(result.kernels)} kernels in the code object, {len(want)} expected")
    for k in result.kernels:
        if int(k.get("wavefront_size", 0)) != target.wave:
            result.problems.append(f"{k.get('name')}: wavefront_size {k.get('wavefront_size')} != {target.wave}")
        if int(k.get("group_segment_fixed_size", 0)) > LDS_BYTES:
            result.problems.append(f"{k.get('name')}: {k.get('group_segment_fixed_size')} B of LDS > {LDS_BYTES}")
    result.ok = not result.problems
    return result


# -- 4. report ----------------------------------------------------------------------------------


def _max(kernels: list[dict[str, str]], key: str) -> int:
    return max((int(k.get(key, 0)) for k in kernels), default=0)


def report(results: list[Result], skipped: dict[str, str], seconds: float, compiler: str) -> str:
    lines = [
        f"hip_check: {compiler}",
        "| header | target | result | kernels | wave | max VGPRs | max SGPRs | max LDS B | scratch B | spills | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        waves = sorted({k.get("wavefront_size", "?") for k in r.kernels}) or ["-"]
        spills = sum(int(k.get("vgpr_spill_count", 0)) + int(k.get("sgpr_spill_count", 0)) for k in r.kernels)
        lines.append(
            f"| {r.header} | {r.target} | {'ok' if r.ok else 'FAIL'} | {len(r.kernels)} | {'/'.join(waves)} "
            f"| {_max(r.kernels, 'vgpr_count')} | {_max(r.kernels, 'sgpr_count')} "
            f"| {_max(r.kernels, 'group_segment_fixed_size')} | {_max(r.kernels, 'private_segment_fixed_size')} "
            f"| {spills} | {r.seconds:.1f} |"
        )
    for header, why in skipped.items():
        lines.append(f"| {header} | all | not compiled: {why} | | | | | | | | |")
    failed = [r for r in results if not r.ok]
    total = sum(len(r.kernels) for r in results)
    lines.append(
        f"hip_check: {len(results) - len(failed)} of {len(results)} (header, target) builds ok, "
        f"{total} kernel code objects, warnings as errors, {seconds:.0f} s"
    )
    for r in failed:
        lines.append(f"hip_check: FAILED {r.header} for {r.target}: {'; '.join(r.problems)}")
        lines.extend("    " + line for line in r.log.strip().splitlines()[:40])
    return "\n".join(lines)


def run_check(
    src: Path, extension: Path, targets: list[Target], device_libs: Path, rocwmma: bool, jobs: int
) -> tuple[list[Result], dict[str, str]]:
    instances = cuda_instances(extension)
    headers = device_headers(src)
    by_header: dict[Path, list[Instance]] = {}
    for h in headers:
        names = kernels_declared(h)
        by_header[h] = [i for i in instances if i.name in names]
    orphans = {i.name for i in instances} - {i.name for h in headers for i in by_header[h]}
    if orphans:
        raise SystemExit(f"hip_check: kernels defined outside the device headers: {sorted(orphans)}")
    skipped = {}
    with tempfile.TemporaryDirectory(prefix="hip_check.") as tmp:
        work = Path(tmp)
        hip_src = hipify(src, work)
        jobs_list = []
        for h, inst in by_header.items():
            if not inst:
                skipped[h.name] = "the CUDA build launches none of its kernels"
                continue
            if "wmma" in h.name and not rocwmma:
                skipped[h.name] = (
                    "needs rocWMMA's headers (rocwmma/rocwmma.hpp), which no package registry here carries"
                )
                continue
            jobs_list.extend((h, t, inst) for t in targets)
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(compile_one, h, hip_src, t, inst, device_libs, work) for h, t, inst in jobs_list]
            results = [f.result() for f in futures]
    return results, skipped


# -- self-test: wave32-only mutations must be caught ----------------------------------------------

MUTATIONS = (
    (
        "kWarpSize as a literal 32 (common.cuh)",
        "common.cuh",
        "constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE__;",
        "constexpr int kWarpSize = 32;",
    ),
    (
        "a raw full-mask shuffle in a kernel (gqa_attention.cuh)",
        "gqa_attention.cuh",
        "s[g] = warp_reduce_sum(part);",
        "s[g] = part + __shfl_xor_sync(0xffffffff, part, 16);",
    ),
)


def self_test(extension: Path, device_libs: Path) -> bool:
    """Applies each mutation to a copy of csrc: the wave-size lint or the gfx942 build must fail."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import check_wave_size

    ok = True
    for what, file, old, new in MUTATIONS:
        with tempfile.TemporaryDirectory(prefix="hip_check_mutant.") as tmp:
            mutant = Path(tmp) / "csrc"
            shutil.copytree(CSRC, mutant)
            text = (mutant / file).read_text()
            if old not in text:
                print(f"hip_check: self-test: {file} no longer contains {old!r}; update the mutation")
                return False
            (mutant / file).write_text(text.replace(old, new, 1))
            lint = check_wave_size.check_paths([mutant])
            results, _ = run_check(mutant, extension, [TARGETS["gfx942"]], device_libs, False, os.cpu_count() or 1)
            built = all(r.ok for r in results)
            caught = bool(lint) or not built
            ok &= caught
            errors = [line.strip() for r in results for line in r.log.splitlines() if "error:" in line]
            print(
                f"hip_check: self-test: {what}: lint {len(lint)} finding(s), gfx942 build "
                f"{'ok' if built else 'failed'} -> {'caught' if caught else 'NOT CAUGHT'}"
            )
            if errors:
                print(f"    first compile error: {errors[0].split('error: ', 1)[1]}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device-libs", type=Path, required=True, help="folder of the ROCm device-library bitcode")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--extension", type=Path, help="the built CUDA extension (default ridgefill_runtime/_C*.so)")
    ap.add_argument("--rocwmma", action="store_true", help="rocWMMA's headers are on the include path")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, help="also write the report here")
    ap.add_argument("--self-test", action="store_true", help="also check that wave32-only mutations are caught")
    args = ap.parse_args()

    unknown = [t for t in args.targets.split(",") if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")
    targets = [TARGETS[t] for t in args.targets.split(",")]
    extension = args.extension or next(iter(sorted((ROOT / "ridgefill_runtime").glob("_C*.so"))), None)
    if extension is None or not extension.exists():
        ap.error("no built extension (ridgefill_runtime/_C*.so): run bash scripts/install.sh with nvcc first")
    version = subprocess.run([CLANG, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]

    start = time.perf_counter()
    results, skipped = run_check(CSRC, extension, targets, args.device_libs, args.rocwmma, args.jobs)
    text = report(results, skipped, time.perf_counter() - start, version)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = all(r.ok for r in results)
    if args.self_test:
        ok &= self_test(extension, args.device_libs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
