"""The package's layers call only down: no import circle (type-only imports counted), no module
reaching into another module's underscore-named members, and no source file over 900 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_act"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """The package modules ``name`` imports anywhere in its source, ``TYPE_CHECKING`` blocks included."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {module for module in found if module in MODULES and module != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, assignments and attributes it sets."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ClassDef):
            names.update(t.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name))
    return {name for name in names if _private(name)}


def test_no_import_circle():
    graph = {name: _imports(name, ast.parse(path.read_text())) for name, path in MODULES.items()}
    # A package's __init__ re-exports its submodules; importing a sibling through it is not a circle.
    for name in graph:
        graph[name] = {m for m in graph[name] if not (MODULES[m].name == "__init__.py" and name.startswith(m + "."))}
    assert _cycles(graph) == []


def test_no_module_calls_another_modules_private_members():
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    defined = {name: _defined(tree) for name, tree in trees.items()}
    reaches = []
    for name, tree in trees.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != name))
        local_classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        # Attributes this module's own classes set are its own, whoever else uses the name.
        own_attributes = {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_act"):
                reaches += [f"{name}: from {node.module} import {a.name}" for a in node.names if _private(a.name)]
            elif (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and node.attr in elsewhere
                and node.attr not in own_attributes
                and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls", *local_classes})
            ):
                reaches.append(f"{name}:{node.lineno}: .{node.attr}")
    assert not reaches, "\n".join(reaches)


def test_no_source_file_is_over_900_lines():
    sources = [*PACKAGE.rglob("*.py"), *(p for p in (PACKAGE.parent / "csrc").iterdir() if p.is_file())]
    long = {str(p.relative_to(PACKAGE.parent)): n for p in sources if (n := len(p.read_text().splitlines())) > 900}
    assert not long, long
