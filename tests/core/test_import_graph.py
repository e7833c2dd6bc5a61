"""The kvstage package has no import cycle.

The graph is built with ``ast`` from src/kvstage: an edge A -> B for every import of a
kvstage module B at module level in A, including imports under ``if TYPE_CHECKING:``
(a cycle through type hints is still two modules that cannot be understood apart).
Imports inside functions are lazy by design (optional dependencies, children spawned
only when run) and are not counted. ``from kvstage.x import y`` counts as an edge to
``kvstage.x.y`` when that is a module, else to ``kvstage.x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvstage

ROOT = Path(kvstage.__file__).resolve().parent
PACKAGE = "kvstage"


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root``."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_level(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports at module level, also inside module-level if/try blocks (TYPE_CHECKING,
    optional fallbacks), never inside a function or class body."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try):
            todo += node.body + node.orelse
            if isinstance(node, ast.Try):
                todo += node.finalbody
                for handler in node.handlers:
                    todo += handler.body
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in _module_level(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".")[: len(name.split(".")) - node.level + is_pkg]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                targets = [f"{parent}.{a.name}" if f"{parent}.{a.name}" in modules else parent
                           for a in node.names]
            for target in targets:
                # `import kvstage.a.b` or an unknown name: the longest known module prefix
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_cycle_finder_names_a_cycle() -> None:
    """The finder itself: a two-module circle and a three-module circle are reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}, "f": set()}
    assert cycles(graph) == [["a", "b"], ["c", "d", "e"]]


def test_graph_sees_type_checking_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "kvstage"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstage.sub.y import Y\n")
    (pkg / "sub" / "y.py").write_text(
        "from . import x\nfrom kvstage.sub import z\n\ndef f():\n    import kvstage.w\n")
    (pkg / "sub" / "z.py").write_text("")
    (pkg / "w.py").write_text("import kvstage.sub.x\n")
    graph = import_graph(module_names(pkg))
    assert graph["kvstage.sub.x"] == {"kvstage.sub.y"}
    assert graph["kvstage.sub.y"] == {"kvstage.sub.x", "kvstage.sub.z"}  # not the lazy one
    assert graph["kvstage.w"] == {"kvstage.sub.x"}
    assert cycles(graph) == [["kvstage.sub.x", "kvstage.sub.y"]]


def test_kvstage_has_no_import_cycle() -> None:
    graph = import_graph(module_names())
    assert len(graph) > 50  # the whole package was read
    found = cycles(graph)
    assert found == [], "import cycles in kvstage (break each with a module both use): " + (
        "; ".join(" <-> ".join(c) for c in found))
