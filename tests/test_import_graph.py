"""The runtime's import graph, read from the source with `ast` (nothing is imported): no module
imports itself through others, and the layers below fill/ never import it.

Module-level imports are those the interpreter runs when the module is imported: at the top, or
inside a top-level `if` / `try` / `with` / class body; not inside a function, and not under
`if TYPE_CHECKING:` (a type named in annotations only). Importing `a.b.c` also runs the packages
`a` and `a.b`, so those are edges too, except the importer's own packages (the interpreter has
begun them before it runs the importer).
"""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = "ridgefill_runtime"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
# Below fill/ (RidgeFill's prefill steers the model; the model knows nothing of it).
BELOW_FILL = ("models", "layers", "cache", "ops", "loader")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(statements: list[ast.stmt], in_functions: bool):
    """The import statements run by `statements`; those inside functions too when `in_functions`."""
    for s in statements:
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            yield s
        elif isinstance(s, ast.If):
            if not _is_type_checking(s.test):
                yield from _imports(s.body, in_functions)
            yield from _imports(s.orelse, in_functions)
        elif isinstance(s, ast.Try):
            for block in (s.body, *(h.body for h in s.handlers), s.orelse, s.finalbody):
                yield from _imports(block, in_functions)
        elif isinstance(s, (ast.With, ast.For, ast.While, ast.ClassDef)):
            yield from _imports(s.body, in_functions)
            yield from _imports(getattr(s, "orelse", []), in_functions)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and in_functions:
            yield from _imports(s.body, in_functions)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The runtime modules an import statement names (a `from m import name` names m.name when
    that is a module, else m)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            here = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return [n for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")]


def _named(module: str, in_functions: bool) -> set[str]:
    """The runtime modules `module`'s import statements name."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    return {target for node in _imports(tree.body, in_functions) for target in _targets(module, node)}


def _edges(module: str, in_functions: bool) -> set[str]:
    """What importing `module` imports: each named module and the packages above it, but not
    `module`'s own packages."""
    out: set[str] = set()
    for target in _named(module, in_functions):
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            own_package = i < len(parts) and module.startswith(name + ".")
            if name in MODULES and name != module and not own_package:
                out.add(name)
    return out


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_graph_reader_sees_the_runtime():
    graph = {m: _edges(m, in_functions=False) for m in MODULES}
    assert len(MODULES) > 100
    assert "ridgefill_runtime.config" in graph["ridgefill_runtime.models.family"]
    # a relative import of a name in a package's __init__ (rms_norm) is an edge to that package
    assert "ridgefill_runtime.ops" in graph["ridgefill_runtime.models.dense"]
    # an import inside a function is not a module-level one
    assert "ridgefill_runtime.llm" not in graph["ridgefill_runtime.fill.fit_cli"]
    assert "ridgefill_runtime.llm" in _edges("ridgefill_runtime.fill.fit_cli", in_functions=True)


def test_no_import_cycles():
    graph = {m: _edges(m, in_functions=False) for m in MODULES}
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_config_imports_no_model_family():
    """Adding a family never edits config.py: it knows none (not even inside a function)."""
    named = _named("ridgefill_runtime.config", in_functions=True)
    assert not [m for m in named if m.startswith("ridgefill_runtime.models")], sorted(named)


def test_nothing_below_fill_imports_fill():
    below = [m for m in MODULES if m.split(".")[1:2] and m.split(".")[1] in BELOW_FILL]
    found = [
        f"{m} imports {t}"
        for m in sorted(below)
        for t in sorted(_named(m, in_functions=True))
        if t == "ridgefill_runtime.fill" or t.startswith("ridgefill_runtime.fill.")
    ]
    assert not found, "\n".join(found)
