"""The vLLM surface kvstage's connector relies on, and a reader of it from a wheel or a tree.

    python scripts/vllm_surface.py --wheel /tmp/v033/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python scripts/vllm_surface.py            # the vLLM installed in this interpreter

Tooling, outside the runtime package (the connector never reads it):
- `SURFACE`: ``(module, name, kind)`` for every vLLM name the connector package
  (kvstage.integrations.vllm) subclasses, overrides, calls or reads. ``kind``: ``"method"``
  (a callable found on the class or its bases: its signature), ``"attr"`` (an instance or
  class attribute assigned somewhere in the class's bases), ``"name"`` (a module-level
  name: a class, a function's signature, or an assignment's value). Private names and
  runtime replacements are each listed, with why, in docs/connector.md "The vLLM surface".
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

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
META = f"{NIXL}.metadata"
STATS = f"{NIXL}.stats"

SURFACE: tuple[tuple[str, str, str], ...] = (
    # KVStageConnector(NixlConnector): connector.py
    (NIXL, "NixlConnector.__init__", "method"),  # overridden: builds kvstage's two classes
    (NIXL, "NixlBaseConnector.__init__", "method"),  # called instead
    (NIXL, "NixlConnector.build_kv_connector_stats", "method"),
    (NIXL, "NixlConnector.build_prom_metrics", "method"),
    (NIXL, "NixlConnector.get_kv_connector_stats", "method"),  # + kvstage's copies
    (NIXL, "NixlConnector.get_transfer_results", "method"),  # + checksum failures
    (NIXL, "NixlConnector.wait_for_save", "method"),  # calls the worker's save_kv_to_host
    (NIXL, "NixlConnector.build_connector_worker_meta", "method"),  # checksums' digests
    # timed by hook_time.time_hooks (called through with whatever vLLM passes)
    *((NIXL, f"NixlConnector.{hook}", "method") for hook in (
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
        "on_new_request", "update_connector_output", "request_finished",
        "request_finished_all_groups", "bind_connector_metadata", "start_load_kv",
        "get_block_ids_with_load_errors", "get_kv_connector_kv_cache_events",
        "clear_connector_metadata")),
    (NIXL, "NixlConnector.connector_worker", "attr"),
    (NIXL, "NixlConnector.connector_scheduler", "attr"),
    (NIXL, "NixlConnector.engine_id", "attr"),
    (BASE, "KVConnectorBase_V1.supports_sleep_mode", "method"),  # 0.33.0
    (BASE, "KVConnectorBase_V1.unregister_kv_caches", "method"),  # 0.33.0
    (BASE, "KVConnectorBase_V1.restore_kv_caches", "method"),  # 0.33.0
    (NIXL, "NixlConnector.supports_sleep_mode", "method"),
    (NIXL, "NixlConnector.unregister_kv_caches", "method"),
    (NIXL, "NixlConnector.restore_kv_caches", "method"),
    (BASE, "KVConnectorTransferResults", "name"),
    (BASE, "KVConnectorTransferResults.finished_recving", "attr"),
    (BASE, "KVConnectorTransferResults.failed_recving", "attr"),
    (BASE, "KVConnectorWorkerMetadata.aggregate", "method"),
    (BASE, "CopyBlocksOp", "name"),
    (BASE, "KVConnectorRole", "name"),
    # KVStageConnectorWorker(NixlConnectorWorker): worker.py
    (NIXL, "NixlConnectorWorker.__init__", "method"),
    (NIXL, "NixlConnectorWorker.initialize_host_xfer_buffer", "method"),
    (NIXL, "NixlConnectorWorker.set_host_xfer_buffer_ops", "method"),
    (NIXL, "NixlConnectorWorker.register_kv_caches", "method"),
    (NIXL, "NixlConnectorWorker.get_kv_connector_stats", "method"),
    (NIXL, "NixlConnectorWorker.save_kv_to_host", "method"),  # replaced: logical ids
    (NIXL, "NixlConnectorWorker.sync_recved_kv_to_device", "method"),  # replaced: same
    (NIXL, "NixlConnectorWorker.start_load_kv", "method"),
    (NIXL, "NixlConnectorWorker._nixl_handshake", "method"),  # private: sealed handshake
    (NIXL, "NixlConnectorWorker._read_blocks_for_req", "method"),  # private: lease check
    (NIXL, "NixlConnectorWorker._handle_failed_transfer", "method"),  # private: lease check
    (NIXL, "NixlConnectorWorker._recv_failures", "attr"),  # private: lease check
    (NIXL, "NixlConnectorWorker._engine_clock_offset", "attr"),  # private: lease check
    (NIXL, "NixlConnectorWorker.use_host_buffer", "attr"),
    (NIXL, "NixlConnectorWorker.host_xfer_buffers", "attr"),
    (NIXL, "NixlConnectorWorker.device_kv_caches", "attr"),
    (NIXL, "NixlConnectorWorker.copy_blocks", "attr"),
    (NIXL, "NixlConnectorWorker.compat_hash", "attr"),
    (NIXL, "NixlConnectorWorker.enforce_compat_hash", "attr"),
    (NIXL, "NixlConnectorWorker.xfer_handshake_metadata", "attr"),
    (NIXL, "NixlConnectorWorker.kv_cache_config", "attr"),
    (NIXL, "NixlConnectorWorker.vllm_config", "attr"),
    (NIXL, "NixlConnectorWorker.xfer_stats", "attr"),
    (NIXL, "NixlConnectorWorker.nixl_wrapper", "attr"),  # its get_new_notifs guarded
    ("vllm.utils.gpu_sync_debug", "gpu_sync_allowed", "name"),  # around the copies, as vLLM
    ("vllm.model_executor.layers.mamba.mamba_utils", "is_conv_state_dim_first", "name"),
    ("vllm.distributed.nixl_utils", "NixlWrapper", "name"),  # its module's nixlBind
    (f"{NIXL}.base_worker", "zmq_ctx", "name"),  # rebound in the sealed handshake's copy
    (f"{NIXL}.base_scheduler", "zmq_ctx", "name"),  # rebound in the sealed listener's copy
    # KVStageConnectorScheduler(NixlConnectorScheduler): scheduler.py
    (NIXL, "NixlConnectorScheduler.__init__", "method"),
    (NIXL, "NixlConnectorScheduler.on_new_request", "method"),  # quiet.py: waits for KV
    (NIXL, "NixlConnectorScheduler.update_state_after_alloc", "method"),
    (NIXL, "NixlConnectorScheduler.request_finished", "method"),
    (NIXL, "NixlConnectorScheduler.build_connector_meta", "method"),
    (NIXL, "NixlConnectorScheduler.update_connector_output", "method"),
    (NIXL, "NixlConnectorScheduler._nixl_handshake_listener", "method"),  # private: sealed
    (NIXL, "NixlConnectorScheduler.get_exchange_clipped_blocks", "method"),
    (NIXL, "NixlConnectorScheduler.use_host_buffer", "attr"),
    (NIXL, "NixlConnectorScheduler.side_channel_host", "attr"),
    (NIXL, "NixlConnectorScheduler.engine_id", "attr"),
    ("vllm.distributed.kv_transfer.kv_connector.utils", "yield_req_data", "name"),
    # the step's metadata and what it carries per request
    (NIXL, "NixlConnectorMetadata", "name"),  # subclassed: KVStageConnectorMetadata
    (NIXL, "NixlConnectorMetadata.reqs_to_save", "attr"),
    *((NIXL, f"NixlConnectorMetadata.{f}", "attr") for f in ("reqs_to_recv", "reqs_to_send",
      "reqs_in_batch", "reqs_not_processed", "heartbeat_by_engine")),  # quiet.py: full steps
    (META, "ReqMeta.awaiting_kvs", "attr"),  # quiet.py: vLLM's rule for the READs it reports
    (NIXL, "NixlConnectorMetadata.add_new_req_to_save", "method"),
    (META, "ReqMeta.local_block_ids", "attr"),
    (META, "ReqMeta.local_physical_block_ids", "attr"),  # checksums (one kernel block)
    (META, "ReqMeta.remote", "attr"),
    (META, "RemoteMeta.block_ids", "attr"),
    (META, "RemoteMeta.engine_id", "attr"),
    # the handshake (secure_handshake.py)
    (NIXL, "NixlHandshakePayload", "name"),
    (META, "GET_META_MSG", "name"),
    (META, "NixlHandshakePayload.compatibility_hash", "attr"),
    (META, "NixlHandshakePayload.agent_metadata_bytes", "attr"),
    # stats.py
    (STATS, "NixlKVConnectorStats.reset", "method"),
    (STATS, "NixlKVConnectorStats.is_empty", "method"),
    (STATS, "NixlKVConnectorStats.aggregate", "method"),
    (STATS, "NixlKVConnectorStats.reduce", "method"),
    (STATS, "NixlKVConnectorStats.record_transfer", "method"),
    (STATS, "NixlKVConnectorStats.record_kv_expired_req", "method"),
    (STATS, "NixlKVConnectorStats.__post_init__", "method"),
    (STATS, "NixlKVConnectorStats.data", "attr"),
    (STATS, "NixlPromMetrics.__init__", "method"),
    (STATS, "NixlPromMetrics.observe", "method"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.metrics", "KVConnectorStats", "name"),
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
