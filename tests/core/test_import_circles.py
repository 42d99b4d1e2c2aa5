"""No import circles between spmdgt's files (docs/design.md "Folders"): the module-level
imports of every file form a graph without a cycle. An import inside a function (one layer
calling up into another at run time) or under ``TYPE_CHECKING`` is not an edge: it runs after
both modules are loaded."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "spmdgt"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is loaded: not in functions, not TYPE_CHECKING's."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            typing_only = "TYPE_CHECKING" in ast.unparse(node.test)
            out += _module_level_imports(node.orelse if typing_only else node.body + node.orelse)
        elif isinstance(node, (ast.Try, ast.With, ast.ClassDef)):
            for block in ("body", "orelse", "finalbody"):
                out += _module_level_imports(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                out += _module_level_imports(handler.body)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # ``from pkg import sub`` loads the submodule; ``from mod import name`` the module
            deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_no_import_circles_between_files():
    graph = _graph()
    assert len(graph) > 100 and graph["spmdgt.train._trainer"]  # the graph was read
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        # graphlib lists each module before the ones importing it: read it backwards
        raise AssertionError(f"an import circle: {' imports '.join(reversed(e.args[1]))}") from None
