"""The kvstage package has no import cycle, and the product loads no tooling.

The graph is built with ``ast`` from src/kvstage: an edge A -> B for every import of a
kvstage module B at module level in A, including imports under ``if TYPE_CHECKING:``
(a cycle through type hints is still two modules that cannot be understood apart).
Imports inside functions are lazy by design (optional dependencies, children spawned
only when run) and are not counted. ``from kvstage.x import y`` counts as an edge to
``kvstage.x.y`` when that is a module, else to ``kvstage.x``.

The product apart from its tooling: ``import kvstage`` and ``kvstage serve-pd --help``, each
in a fresh interpreter, leave no module of ``kvstage.bench``, ``kvstage.testing`` or the
repository's ``bench/`` folder in ``sys.modules``; nothing under src/ imports ``bench``.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvstage
from kvstage import cli

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


# -- the product apart from its tooling (issue 25 item 4) ------------------------------
#: what the product must never load: benchmark, soak and test code
TOOLING = ("kvstage.bench", "kvstage.testing", "bench")
REPO = ROOT.parents[1]


def _loaded_tooling(code: str) -> tuple[list[str], str]:
    """Run ``code`` in a fresh interpreter (from the repository, so the ``bench`` folder is
    importable); the tooling modules it left in ``sys.modules``, and what it printed."""
    probe = (f"{code}\nimport sys\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] == 'bench' "
             f"or m.startswith({TOOLING[:2]!r})))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    *printed, last = proc.stdout.splitlines()
    return ast.literal_eval(last), "\n".join(printed)


def test_probe_sees_tooling() -> None:
    """The probe itself: importing the soak is reported, with what it pulled in."""
    found, _ = _loaded_tooling("import bench.soak")
    assert {"bench", "bench.soak", "bench.hostile", "kvstage.bench.report",
            "kvstage.testing.servers"} <= set(found)


def test_import_kvstage_loads_no_tooling() -> None:
    assert _loaded_tooling("import kvstage") == ([], "")


def test_serve_pd_help_loads_no_tooling() -> None:
    code = ("import contextlib, sys\nfrom kvstage.cli import main\n"
            "with contextlib.suppress(SystemExit):\n    main(['serve-pd', '--help'])\n"
            "print('serve_pd loaded:', 'kvstage.cli.serve_pd' in sys.modules)")
    found, printed = _loaded_tooling(code)
    assert found == []
    assert printed.startswith("usage: kvstage serve-pd ")
    assert printed.endswith("serve_pd loaded: True")  # the command did run


def test_top_help_lists_every_command_and_imports_none() -> None:
    code = ("import contextlib, sys\nfrom kvstage.cli import main\n"
            "with contextlib.suppress(SystemExit):\n    main(['--help'])\n"
            "from kvstage.cli import COMMANDS\n"
            "print('modules:', [m for _, m, _ in COMMANDS if m in sys.modules])")
    found, printed = _loaded_tooling(code)
    assert found == []
    assert printed.endswith("modules: []")
    for path, _, help_text in cli.COMMANDS:
        assert f"    {path[0]} " in printed
        if len(path) == 1:  # the groups' subcommands are listed by `kvstage bench --help`
            assert help_text in " ".join(printed.split()), path


@pytest.mark.parametrize(("path", "module_name"), [(p, m) for p, m, _ in cli.COMMANDS],
                         ids=[" ".join(p) for p, _, _ in cli.COMMANDS])
def test_every_command_module_exists(path: tuple[str, ...], module_name: str) -> None:
    """The lazy table never skips a command: each module imports and has the two calls."""
    module = importlib.import_module(module_name)
    assert callable(module.add_arguments) and callable(module.run), path


def test_selected_command() -> None:
    assert cli.selected_command(["bench", "copy", "--quick"]) == ("bench", "copy")
    assert cli.selected_command(["serve-pd", "--help"]) == ("serve-pd",)
    assert cli.selected_command(["bench", "--help"]) is None
    assert cli.selected_command(["--help"]) is None
    assert cli.selected_command(["bench", "soak"]) is None  # moved out: argparse refuses it


def test_package_bench_is_the_copy_bench_only() -> None:
    """Soaks and the other benchmarks live in the repository's bench/ folder."""
    names = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert names == {"__init__", "copy", "copy_bench", "copy_cases", "copy_counts", "floor",
                     "report"}


def test_src_never_imports_the_bench_folder() -> None:
    offenders = []
    for name, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):  # lazy imports too
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            offenders += [f"{name}: {t}" for t in targets if t.split(".")[0] == "bench"]
    assert offenders == []
