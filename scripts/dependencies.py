"""Print ridgefill's dependencies from pyproject.toml, one per line, with the given extras'.

scripts/install.sh installs them (with build isolation) before ridgefill itself (without it),
so pyproject.toml stays the one list."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
extras = project.get("optional-dependencies", {})
unknown = [name for name in sys.argv[1:] if name not in extras]
if unknown:
    sys.exit(f"dependencies: unknown extra(s) {unknown}; known: {sorted(extras)}")
for requirement in project["dependencies"] + [r for name in sys.argv[1:] for r in extras[name]]:
    print(requirement)
