"""The folders server/ and clients/ install as ridgefill_server and ridgefill_clients: bare
top-level `server` and `clients` would collide with any other package of those names in a
user's environment. Checked on the packaging config (setuptools' resolved pyproject.toml), on the
installed distribution when it is this tree's, and on the repository's own imports."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BARE = {"server", "clients"}
FOLDERS = {"ridgefill_server": "server", "ridgefill_clients": "clients"}


def _setuptools_config() -> dict:
    from setuptools.config.pyprojecttoml import read_configuration

    return read_configuration(ROOT / "pyproject.toml", expand=True)["tool"]["setuptools"]


def test_the_packaging_config_installs_no_bare_server_or_clients():
    config = _setuptools_config()
    tops = {p.split(".")[0] for p in config["packages"]}
    assert tops == {"ridgefill_runtime", "ridgefill_server", "ridgefill_clients"}, sorted(tops)
    assert config["package-dir"] == FOLDERS
    # The list is explicit: every runtime package folder must be on it, or a wheel would lack it.
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ridgefill_runtime").rglob("__init__.py")}
    assert folders == {p for p in config["packages"] if p.split(".")[0] == "ridgefill_runtime"}
    for name, folder in FOLDERS.items():
        assert not [p for p in (ROOT / folder).rglob("__init__.py") if p.parent != ROOT / folder], (
            f"{folder}/ has subpackages; list them under {name} in pyproject.toml"
        )


def test_the_new_names_import_this_trees_folders():
    for name, folder in FOLDERS.items():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not importable"
        assert [Path(p).resolve() for p in spec.submodule_search_locations] == [(ROOT / folder).resolve()]


def _installed_top_level_names(dist: importlib.metadata.Distribution) -> set[str]:
    """The top-level names the installed distribution provides: its top_level.txt, and for an
    editable install also the names its import hook maps (setuptools' __editable__ finder)."""
    names = set((dist.read_text("top_level.txt") or "").split())
    for f in dist.files or []:
        if f.name.startswith("__editable__") and f.name.endswith("_finder.py"):
            tree = ast.parse(Path(f.locate()).read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    if any(isinstance(t, ast.Name) and t.id == "MAPPING" for t in targets):
                        names |= set(ast.literal_eval(node.value))
    return names


def test_the_installed_distribution_provides_no_bare_server_or_clients():
    try:
        dist = importlib.metadata.distribution("ridgefill")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ridgefill is not installed")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url != ROOT.as_uri():
        pytest.skip(f"the installed ridgefill is not this tree's ({url or 'no direct_url.json'})")
    names = _installed_top_level_names(dist)
    assert {"ridgefill_runtime", "ridgefill_server", "ridgefill_clients"} <= names, sorted(names)
    assert not names & BARE, sorted(names)


def _absolute_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _python_files() -> list[Path]:
    """The repository's .py files, not those of environments or builds inside it (.venv, build/)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in ("build", "__pycache__")]
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(out)


def test_nothing_in_the_repository_imports_the_bare_names():
    found = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _python_files()
        for name in _absolute_imports(path)
        if name.split(".")[0] in BARE
    ]
    assert not found, "\n".join(found)
