"""The vLLM surface kvstage's connector relies on, and a reader of it from a wheel or a tree.

    python scripts/vllm_surface.py --wheel /tmp/v033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python scripts/vllm_surface.py            # the vLLM installed in this interpreter

Tooling, outside the runtime package (the connector never reads it):
- `SURFACE`: ``(module, name, kind)`` for every vLLM name the connector package
  (kvstage.integrations.vllm) subclasses, overrides, calls or reads: vLLM's public
  connector API (``KVConnectorBase_V1``), the request fields its scheduler side reads, the
  stats base classes, and one private name (listed, with why, in docs/connector.md).
  ``kind``: ``"method"`` (a callable found on the class or its bases: its signature),
  ``"attr"`` (an instance or class attribute assigned somewhere in the class's bases),
  ``"name"`` (a module-level name: a class, a function's signature, or an assignment's
  value). The connector replaces nothing at run time and copies no vLLM function.
- `read_surface(source)`: ``{"module:name": description}`` for every entry, where
  ``source`` maps a module name to its text (`wheel_source`: a vLLM wheel read with
  ``zipfile``; `tree_source`: an unpacked tree such as an installed ``site-packages``). Never
  imports vLLM: a wheel for another platform (vLLM's CUDA wheel) is read the same way.
- A description: a signature without annotations (vLLM rewrites those without changing
  what a call binds; ``classmethod`` / ``property`` prefixed), ``attribute``, ``class``,
  ``= <value>``, ``: <annotation>`` for a name only declared (``NixlWrapper``), or
  ``MISSING``.

Resolution follows imports, ``y = x`` aliases and class bases (depth-first); else MISSING.
Get a wheel with ``pip download --no-deps vllm==X.Y.Z -d DIR``. The output is the literal
for ``SURFACES`` in tests/integrations/test_vllm_surface.py once the version has been checked
(read what changed, run tests/system/vllm on it); ``--diff VERSION``: only what differs from
that recorded version. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
REQUEST = "vllm.v1.request"

SURFACE: tuple[tuple[str, str, str], ...] = (
    # KVStageConnector(KVConnectorBase_V1, SupportsHMA): connector.py
    (BASE, "KVConnectorBase_V1.__init__", "method"),
    (BASE, "SupportsHMA", "name"),
    (BASE, "SupportsHMA.request_finished_all_groups", "method"),
    (BASE, "KVConnectorRole", "name"),
    (BASE, "KVConnectorMetadata", "name"),  # subclassed: metadata.StepMeta
    (BASE, "KVConnectorTransferResults", "name"),
    (BASE, "KVConnectorTransferResults.finished_sending", "attr"),
    (BASE, "KVConnectorTransferResults.finished_recving", "attr"),
    (BASE, "KVConnectorTransferResults.failed_recving", "attr"),
    # the hooks it overrides (vLLM calls them with what the base class declares)
    *((BASE, f"KVConnectorBase_V1.{hook}", "method") for hook in (
        "register_kv_caches", "bind_connector_metadata", "clear_connector_metadata",
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
        "get_transfer_results", "get_finished", "shutdown", "get_kv_connector_stats",
        "build_kv_connector_stats", "build_prom_metrics", "get_num_new_matched_tokens",
        "update_state_after_alloc", "build_connector_meta", "update_connector_output",
        "request_finished", "on_new_request")),
    (BASE, "KVConnectorBase_V1.supports_sleep_mode", "method"),  # 0.33.0
    (BASE, "KVConnectorBase_V1.unregister_kv_caches", "method"),  # 0.33.0
    (BASE, "KVConnectorBase_V1.restore_kv_caches", "method"),  # 0.33.0
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", "name"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_world_size", "name"),
    ("vllm.model_executor.layers.mamba.mamba_utils", "is_conv_state_dim_first", "name"),
    # scheduler.py: what it reads of a request and of the step
    ("vllm.distributed.kv_transfer.kv_connector.utils", "yield_req_data", "name"),
    (REQUEST, "RequestStatus", "name"),
    (REQUEST, "Request.kv_transfer_params", "attr"),
    (REQUEST, "Request.prompt_token_ids", "attr"),
    (REQUEST, "Request.num_prompt_tokens", "attr"),
    (REQUEST, "Request.max_tokens", "attr"),
    (REQUEST, "Request._all_token_ids", "attr"),  # private: the prefill stops at N - 1
    # stats.py
    (METRICS, "KVConnectorStats", "name"),
    (METRICS, "KVConnectorStats.data", "attr"),
    (METRICS, "KVConnectorPromMetrics.__init__", "method"),
    (METRICS, "KVConnectorPromMetrics.per_engine_labelvalues", "attr"),
    ("vllm.v1.metrics.utils", "create_metric_per_engine", "name"),
)

#: module name -> (its text, whether it is a package's __init__), or None
Source = Callable[[str], tuple[str, bool] | None]


def tree_source(root: str | Path) -> Source:
    """Module text from a directory holding the ``vllm`` package (e.g. site-packages)."""
    base = Path(root)

    def read(module: str) -> tuple[str, bool] | None:
        rel = Path(*module.split("."))
        for p, pkg in ((base / rel.with_suffix(".py"), False), (base / rel / "__init__.py", True)):
            if p.is_file():
                return p.read_text(encoding="utf-8"), pkg
        return None

    return read


def wheel_source(wheel: str | Path) -> Source:
    """Module text from a vLLM wheel, read with ``zipfile`` (nothing is imported)."""
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())

    def read(module: str) -> tuple[str, bool] | None:
        rel = module.replace(".", "/")
        for p, pkg in ((f"{rel}.py", False), (f"{rel}/__init__.py", True)):
            if p in names:
                return zf.read(p).decode("utf-8"), pkg
        return None

    return read


class _Resolver:
    def __init__(self, source: Source) -> None:
        self.source = source
        self._trees: dict[str, ast.Module | None] = {}
        self._packages: dict[str, bool] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            found = self.source(module)
            self._trees[module] = None if found is None else ast.parse(found[0])
            self._packages[module] = found is not None and found[1]
        return self._trees[module]

    def lookup(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The defining node of ``module.name``, following imports and aliases."""
        tree = self.tree(module)
        if tree is None or depth > 12:
            return None
        found: tuple[str, ast.AST] | None = None
        for node in tree.body:  # the last binding at module level wins, as at run time
            hit = self._binding(module, node, name, depth)
            if hit is not None:
                found = hit
        return found

    def _binding(self, module: str, node: ast.stmt, name: str,
                 depth: int) -> tuple[str, ast.AST] | None:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return (module, node) if node.name == name else None
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    src = self._absolute(module, node)
                    return self.lookup(src, alias.name, depth + 1) or (src, node)
            return None
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            value = getattr(node, "value", None)
            if isinstance(value, ast.Name):  # X = Y: an alias
                return self.lookup(module, value.id, depth + 1) or (module, node)
            return module, node
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        # a package's __init__ is its own base for "from .x import y"; a module's is its parent
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if self._packages.get(module) else 0)
        base = ".".join(parts[:keep])
        return f"{base}.{node.module}" if node.module else base

    def mro(self, module: str, cls: ast.ClassDef, depth: int = 0) -> Iterator[ast.ClassDef]:
        yield cls
        if depth > 12:
            return
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else None
            if name is None:
                continue
            hit = self.lookup(module, name)
            if hit is not None and isinstance(hit[1], ast.ClassDef):
                yield from self.mro(hit[0], hit[1], depth + 1)


def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """``(a, b=<default>, *args, c, **kw)`` without annotations, decorators prefixed."""
    a = fn.args
    parts: list[str] = []
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults))
    defaults += list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        parts.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            parts.append("/")
    if a.vararg is not None:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        parts.append(arg.arg if kw_default is None else f"{arg.arg}={ast.unparse(kw_default)}")
    if a.kwarg is not None:
        parts.append(f"**{a.kwarg.arg}")
    deco = [ast.unparse(d) for d in fn.decorator_list]
    prefix = "".join(f"{d} " for d in deco if d in ("classmethod", "staticmethod", "property"))
    return f"{prefix}({', '.join(parts)})"


def _assigns_attr(cls: ast.ClassDef, attr: str) -> bool:
    for node in cls.body:  # class-level: x = ..., x: T (dataclass fields too)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == attr:
            return True
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == attr for t in node.targets):
            return True
    for sub in ast.walk(cls):  # self.x = ... / self.x: T = ... in any method
        if isinstance(sub, ast.Assign):
            targets = [t2 for t in sub.targets for t2 in ast.walk(t)]
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        else:
            continue
        if any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
               and t.value.id == "self" for t in targets):
            return True
    return False


def describe(resolver: _Resolver, module: str, name: str, kind: str) -> str:
    head, _, member = name.partition(".")
    hit = resolver.lookup(module, head)
    if hit is None:
        return "MISSING"
    where, node = hit
    if not member:
        if isinstance(node, ast.ClassDef):
            return "class"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return signature(node)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            return f"= {ast.unparse(node.value)}"
        if isinstance(node, ast.AnnAssign):  # declared, bound lazily (module __getattr__)
            return f": {ast.unparse(node.annotation)}"
        return "MISSING"
    if not isinstance(node, ast.ClassDef):
        return "MISSING"
    for cls in resolver.mro(where, node):
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == member:
                if kind == "attr":
                    return "attribute"  # a property or method read as an attribute
                return signature(item)
    if kind == "attr" and any(_assigns_attr(c, member) for c in resolver.mro(where, node)):
        return "attribute"
    return "MISSING"


def read_surface(source: Source) -> dict[str, str]:
    """``{"module:name": description}`` for every `SURFACE` entry."""
    resolver = _Resolver(source)
    return {f"{m}:{n}": describe(resolver, m, n, k) for m, n, k in SURFACE}


def private_names() -> list[str]:
    """The `SURFACE` names with a private part (``_x``, not ``__x__``), each once."""
    out: list[str] = []
    for module, name, _ in SURFACE:
        key = f"{module}:{name}"
        if key not in out and any(p.startswith("_") and not p.endswith("__")
                                  for p in name.split(".")):
            out.append(key)
    return out


def package_version(source: Source) -> str | None:
    """``__version__`` from vLLM's ``vllm/_version.py`` in ``source`` (what setuptools-scm
    writes into the wheel)."""
    found = source("vllm._version")
    if found is None:
        return None
    for node in ast.parse(found[0]).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        value = getattr(node, "value", None)
        if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets) \
                and isinstance(value, ast.Constant):
            return str(value.value)
    return None


def installed_tree() -> Path | None:
    """The directory holding the installed ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", help="a vLLM wheel (.whl) to read")
    parser.add_argument("--tree", help="a directory holding the vllm package")
    parser.add_argument("--diff", metavar="VERSION",
                        help="print only what differs from this recorded version")
    args = parser.parse_args(argv)
    source: Source
    if args.wheel:
        if not Path(args.wheel).is_file() or not args.wheel.endswith(".whl"):
            print(f"error: --wheel expects a .whl file, got {args.wheel!r}; get one with "
                  "`pip download --no-deps vllm==X.Y.Z -d DIR`", file=sys.stderr)
            return 2
        source = wheel_source(args.wheel)
    else:
        tree = Path(args.tree) if args.tree else installed_tree()
        if tree is None or not (tree / "vllm" / "__init__.py").is_file():
            print(f"error: no vllm package under {tree}; pass --tree DIR (the directory "
                  "that holds vllm/) or --wheel FILE", file=sys.stderr)
            return 2
        source = tree_source(tree)
    version = package_version(source)
    surface = read_surface(source)
    if args.diff:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.integrations.test_vllm_surface import SURFACES

        recorded = SURFACES.get(args.diff)
        if recorded is None:
            print(f"error: no recorded surface for {args.diff!r}; recorded: "
                  f"{sorted(SURFACES)}", file=sys.stderr)
            return 2
        for key in sorted(set(surface) | set(recorded)):
            if surface.get(key) != recorded.get(key):
                print(f"{key}\n  {args.diff}: {recorded.get(key)}\n  {version}: {surface.get(key)}")
        return 0
    body = ",\n".join(f"        {json.dumps(k)}: {json.dumps(v)}" for k, v in surface.items())
    print(f'    "{version}": {{\n{body},\n    }},')
    return 0


if __name__ == "__main__":
    sys.exit(main())
