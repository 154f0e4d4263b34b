"""Reproducible local text: Debian's linux-doc-6.1 and python3.11-doc reST sources, and code:
the Python standard library's sources on this machine.

Calibration, held-out (λ) and evaluation documents are disjoint by construction: calibration
and held-out come from the kernel docs, split by the content hash; evaluation from the
Python docs. For code, calibration and held-out are the standard library's top-level modules
(split by content hash the same way) and evaluation the packages in CODE_EVAL_PACKAGES, which
no top-level module is part of. Every document is named and listed by its sha256.
"""

from __future__ import annotations

import gzip
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

KERNEL_DOCS = Path("/usr/share/doc/linux-doc-6.1/Documentation")
PYTHON_DOCS = Path("/usr/share/doc/python3.11-doc/html/_sources")
INSTALL_HINT = "apt-get install -y linux-doc-6.1 python3.11-doc"


@dataclass(frozen=True)
class TextDoc:
    path: str
    sha256: str
    text: str


def read_text(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return raw.decode("utf-8", errors="replace")


def load_docs(root: Path, pattern: str) -> list[TextDoc]:
    """Every matching file under root, ordered by content hash (a fixed, arbitrary order)."""
    if not root.exists():
        raise FileNotFoundError(f"{root} is missing: {INSTALL_HINT}")
    docs = []
    for p in sorted(root.rglob(pattern)):
        text = read_text(p)
        docs.append(TextDoc(str(p), hashlib.sha256(text.encode()).hexdigest(), text))
    return sorted(docs, key=lambda d: d.sha256)


def calibration_and_heldout(min_chars: int = 6000) -> tuple[list[TextDoc], list[TextDoc]]:
    """Kernel docs of some length: hash starting 0-b -> calibration, c-d -> held-out."""
    docs = [d for d in load_docs(KERNEL_DOCS, "*.rst.gz") if len(d.text) >= min_chars]
    calib = [d for d in docs if d.sha256[0] in "0123456789ab"]
    held = [d for d in docs if d.sha256[0] in "cd"]
    return calib, held


def evaluation_docs() -> list[TextDoc]:
    """Python docs (never used by the fit)."""
    return load_docs(PYTHON_DOCS, "*.rst.txt")


# The standard library's packages (folders) whose sources make the code evaluation prompts;
# the code maps are fitted on the top-level modules only, so these are never calibration text.
CODE_EVAL_PACKAGES = ("asyncio", "email", "logging", "multiprocessing", "importlib", "http", "xml", "unittest")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def code_calibration_and_heldout(min_chars: int = 6000) -> tuple[list[TextDoc], list[TextDoc]]:
    """The standard library's top-level modules (no package's files) of some length: hash
    starting 0-b -> calibration, c-d -> held-out."""
    docs = [d for d in load_docs(stdlib_root(), "*.py") if len(d.text) >= min_chars]
    top_level = [d for d in docs if Path(d.path).parent == stdlib_root()]
    calib = [d for d in top_level if d.sha256[0] in "0123456789ab"]
    held = [d for d in top_level if d.sha256[0] in "cd"]
    return calib, held


def code_package_files(package: str) -> list[TextDoc]:
    """The .py files of one standard-library package (CODE_EVAL_PACKAGES), in content-hash order."""
    if package not in CODE_EVAL_PACKAGES:
        raise ValueError(f"{package!r} is not an evaluation package (those are {', '.join(CODE_EVAL_PACKAGES)})")
    return load_docs(stdlib_root() / package, "*.py")
