"""Flags warp-size assumptions in the GPU sources that hold on 32-lane warps only.

NVIDIA warps and RDNA wavefronts (gfx1201 by default) have 32 lanes; CDNA (gfx90a, gfx942) has 64,
and RDNA can be built for 64. A kernel stays correct on both only if every lane/warp index, mask
and cross-lane operation goes through csrc/common.cuh (kWarpSize, kTeamSize, warp_reduce_*,
reduce_sum_32, shfl_xor). The compile check (scripts/hip_check.sh) cannot see a wave32-only
construct that still compiles, so this reads the sources for the usual ones:

  raw-intrinsic  a warp intrinsic (__shfl*, __ballot*, __activemask, __syncwarp, ...) outside
                 common.cuh: its lane count or mask is the caller's guess
  full-mask      a literal 0xffffffff lane mask: 32 lanes of a 64-lane wavefront
  lane-literal   a lane or warp index from threadIdx (or tid) with a literal 32 / 31 / >> 5

A line may opt out with a trailing `// wave-size: <why>` comment (common.cuh's NVIDIA-only
shuffle does). Usage: python scripts/check_wave_size.py [files or folders, default csrc/];
exit 1 with one line per finding.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

GPU_SUFFIXES = (".cu", ".cuh", ".hip")
OWNER = "common.cuh"  # the one file allowed to call the warp intrinsics
OPT_OUT = re.compile(r"//\s*wave-size:\s*\S")

RULES: tuple[tuple[str, re.Pattern[str], str, bool], ...] = (
    # (rule, pattern, message, applies inside common.cuh)
    (
        "raw-intrinsic",
        re.compile(
            r"\b__(shfl\w*|ballot\w*|activemask|syncwarp|any_sync|all_sync|uni_sync|match_\w+|reduce_\w+_sync)\s*\("
        ),
        "warp intrinsic outside common.cuh; use its helpers (shfl_xor, warp_reduce_*, reduce_sum_32)",
        False,
    ),
    (
        "full-mask",
        re.compile(r"\b0[xX][fF]{8}(?![0-9a-fA-F])[uUlL]*"),
        "literal 32-lane mask; a wave64 wavefront has 64 lanes",
        True,
    ),
    (
        "lane-literal",
        re.compile(r"\b(threadIdx\.[xyz]|tid|lane_id|thread)\s*(%\s*32|/\s*32|&\s*31|>>\s*5)\b"),
        "lane or warp index from a literal 32; use kWarpSize (hardware warps) or kTeamSize (32-lane teams)",
        True,
    ),
)


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    rule: str
    message: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}: {self.text.strip()}"


def _strip_comment(line: str) -> str:
    """The code part of a line (a `//` comment is not code; good enough for these patterns)."""
    at = line.find("//")
    return line if at < 0 else line[:at]


def check_text(path: Path, text: str) -> list[Finding]:
    """Findings in one source file's text."""
    is_owner = path.name == OWNER
    findings = []
    in_block_comment = False
    for number, line in enumerate(text.splitlines(), start=1):
        code = line
        if in_block_comment:
            end = code.find("*/")
            if end < 0:
                continue
            code, in_block_comment = code[end + 2 :], False
        start = code.find("/*")
        if start >= 0 and code.find("*/", start) < 0:
            code, in_block_comment = code[:start], True
        if OPT_OUT.search(line):
            continue
        code = _strip_comment(code)
        for rule, pattern, message, in_owner in RULES:
            if is_owner and not in_owner:
                continue
            if pattern.search(code):
                findings.append(Finding(path, number, rule, message, line))
    return findings


def gpu_sources(paths: list[Path]) -> list[Path]:
    """The GPU source files under the given files and folders, sorted."""
    files: set[Path] = set()
    for p in paths:
        if p.is_dir():
            files.update(f for f in p.rglob("*") if f.suffix in GPU_SUFFIXES)
        elif p.suffix in GPU_SUFFIXES:
            files.add(p)
        elif not p.exists():
            raise FileNotFoundError(f"check_wave_size: no such file or folder: {p}")
    return sorted(files)


def check_paths(paths: list[Path]) -> list[Finding]:
    return [f for path in gpu_sources(paths) for f in check_text(path, path.read_text())]


def main(argv: list[str]) -> int:
    roots = [Path(a) for a in argv] or [Path(__file__).resolve().parent.parent / "csrc"]
    try:
        findings = check_paths(roots)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    for f in findings:
        print(f)
    n = len(gpu_sources(roots))
    print(f"check_wave_size: {n} GPU source files, {len(findings)} wave32-only constructs")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
