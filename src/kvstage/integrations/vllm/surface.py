"""The part of vLLM that kvstage's connector overrides or uses, read from source with `ast`.

Contract
--------
- `SURFACE`: ``(module, name, kind)`` for every vLLM name the connector package
  (`connector`, `stats`, `secure_handshake`) subclasses, overrides, calls or reads: the list in
  connector.py's docstring "The subclass surface", plus vLLM's stats classes, the sleep-mode
  hooks of 0.33.0 and the module-level names imported. ``kind``: ``"method"`` (a callable
  found on the class or its bases: its signature), ``"attr"`` (an instance or class
  attribute assigned somewhere in the class's bases), ``"name"`` (a module-level name: a
  class, a function's signature, or an assignment's value).
- `read_surface(source)`: ``{"module:name": description}`` for every entry, where
  ``source`` maps a module name to its text (`wheel_source`: a vLLM wheel read with
  ``zipfile``; `tree_source`: an unpacked tree such as an installed ``site-packages``). Never
  imports vLLM: a wheel for another platform (vLLM's CUDA wheel) is read the same way.
- A description: a signature without annotations (``(self, vllm_config, role,
  kv_cache_config)``; ``classmethod`` / ``property`` prefixed), ``attribute``, ``class``,
  ``= <value>`` for an assignment, ``: <annotation>`` for a name only declared (vLLM binds
  ``NixlWrapper`` in a module ``__getattr__``), or ``MISSING``. Annotations are left out on purpose:
  vLLM rewrites them (``Optional[X]`` -> ``X | None``) without changing what a call binds.

Resolution follows ``from x import y`` (absolute and relative), ``y = x`` aliases at module
level and class bases, depth-first over the bases in order (enough for vLLM's single
inheritance chains); a name that cannot be resolved is ``MISSING``. No thread, no state.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

SURFACE: tuple[tuple[str, str, str], ...] = (
    # KVStageConnector(NixlConnector)
    (NIXL, "NixlConnector.__init__", "method"),
    (NIXL, "NixlBaseConnector.__init__", "method"),
    (NIXL, "NixlConnector.build_kv_connector_stats", "method"),
    (NIXL, "NixlConnector.build_prom_metrics", "method"),
    (NIXL, "NixlConnector.get_kv_connector_stats", "method"),
    (NIXL, "NixlConnector.wait_for_save", "method"),
    (NIXL, "NixlConnector.connector_worker", "attr"),
    (NIXL, "NixlConnector.connector_scheduler", "attr"),
    (NIXL, "NixlConnector.engine_id", "attr"),
    (BASE, "KVConnectorBase_V1.supports_sleep_mode", "method"),  # 0.33.0
    (BASE, "KVConnectorBase_V1.unregister_kv_caches", "method"),  # 0.33.0
    (BASE, "KVConnectorBase_V1.restore_kv_caches", "method"),  # 0.33.0
    (NIXL, "NixlConnector.supports_sleep_mode", "method"),
    (NIXL, "NixlConnector.unregister_kv_caches", "method"),
    (NIXL, "NixlConnector.restore_kv_caches", "method"),
    # KVStageConnectorWorker(NixlConnectorWorker)
    (NIXL, "NixlConnectorWorker.__init__", "method"),
    (NIXL, "NixlConnectorWorker.initialize_host_xfer_buffer", "method"),
    (NIXL, "NixlConnectorWorker.set_host_xfer_buffer_ops", "method"),
    (NIXL, "NixlConnectorWorker.register_kv_caches", "method"),
    (NIXL, "NixlConnectorWorker._nixl_handshake", "method"),
    (NIXL, "NixlConnectorWorker.get_kv_connector_stats", "method"),
    (NIXL, "NixlConnectorWorker.save_kv_to_host", "method"),  # replaced: logical ids (state.py)
    (NIXL, "NixlConnectorWorker.sync_recved_kv_to_device", "method"),  # replaced: same
    (NIXL, "NixlConnectorWorker._logical_to_kernel_block_ids", "method"),  # save's meta
    (NIXL, "NixlConnectorWorker._physical_blocks_per_logical_kv_block", "attr"),
    (NIXL, "NixlConnectorWorker.device_kv_caches", "attr"),
    ("vllm.utils.gpu_sync_debug", "gpu_sync_allowed", "name"),  # around the copies, as vLLM
    ("vllm.model_executor.layers.mamba.mamba_utils", "is_conv_state_dim_first", "name"),
    (NIXL, "NixlConnectorWorker.sync_recved_kv_to_device", "method"),  # calls copy_blocks
    (NIXL, "NixlConnectorWorker.use_host_buffer", "attr"),
    (NIXL, "NixlConnectorWorker.host_xfer_buffers", "attr"),
    (NIXL, "NixlConnectorWorker.device_kv_caches", "attr"),
    (NIXL, "NixlConnectorWorker.copy_blocks", "attr"),
    (NIXL, "NixlConnectorWorker.compat_hash", "attr"),
    (NIXL, "NixlConnectorWorker.enforce_compat_hash", "attr"),
    (NIXL, "NixlConnectorWorker.xfer_handshake_metadata", "attr"),
    (NIXL, "NixlConnectorWorker.kv_transfer_config", "attr"),
    (NIXL, "NixlConnectorWorker.kv_cache_config", "attr"),
    (NIXL, "NixlConnectorWorker.xfer_stats", "attr"),
    (NIXL, "NixlConnectorWorker.nixl_wrapper", "attr"),
    # checksums.py (kvstage_verify_checksum)
    (NIXL, "NixlConnectorWorker.start_load_kv", "method"),
    (NIXL, "NixlConnectorWorker._pop_done_transfers", "method"),
    (NIXL, "NixlConnectorWorker._recving_transfers", "attr"),
    (NIXL, "NixlConnectorWorker._recving_metadata", "attr"),
    (NIXL, "NixlConnectorWorker._physical_blocks_per_logical_kv_block", "attr"),
    (NIXL, "NixlConnectorScheduler.build_connector_meta", "method"),
    (NIXL, "NixlConnectorScheduler.update_connector_output", "method"),
    (NIXL, "NixlConnectorScheduler._reqs_need_recv", "attr"),
    (NIXL, "NixlConnector.build_connector_worker_meta", "method"),
    # lease.py (the lease check before a READ)
    (NIXL, "NixlConnectorWorker._read_blocks_for_req", "method"),
    (NIXL, "NixlConnectorWorker._handle_failed_transfer", "method"),
    (NIXL, "NixlConnectorWorker._recv_failures", "attr"),
    (NIXL, "NixlConnectorWorker._engine_clock_offset", "attr"),
    (NIXL, "NixlConnectorWorker._invalid_remote_engines", "attr"),
    (NIXL, "NixlConnectorScheduler._kv_lease_duration", "attr"),
    (f"{NIXL}.stats", "NixlKVConnectorStats.record_kv_expired_req", "method"),
    (BASE, "KVConnectorWorkerMetadata.aggregate", "method"),
    # KVStageConnectorScheduler(NixlConnectorScheduler)
    (NIXL, "NixlConnectorScheduler.__init__", "method"),
    (NIXL, "NixlConnectorScheduler._build_save_meta", "method"),
    (NIXL, "NixlConnectorScheduler.request_finished", "method"),
    (NIXL, "NixlConnectorScheduler._nixl_handshake_listener", "method"),
    (NIXL, "NixlConnectorScheduler.get_exchange_clipped_blocks", "method"),
    (NIXL, "NixlConnectorScheduler.use_host_buffer", "attr"),
    (NIXL, "NixlConnectorScheduler._reqs_need_save", "attr"),
    (NIXL, "NixlConnectorScheduler.side_channel_host", "attr"),
    # module-level names the package imports
    (NIXL, "NixlHandshakePayload", "name"),
    (f"{NIXL}.metadata", "GET_META_MSG", "name"),
    (f"{NIXL}.metadata", "NixlHandshakePayload.compatibility_hash", "attr"),
    (f"{NIXL}.metadata", "NixlHandshakePayload.agent_metadata_bytes", "attr"),
    (f"{NIXL}.base_worker", "zmq_ctx", "name"),
    ("vllm.distributed.kv_transfer.kv_connector.utils", "yield_req_data", "name"),
    (BASE, "CopyBlocksOp", "name"),
    (BASE, "KVConnectorRole", "name"),
    ("vllm.distributed.nixl_utils", "NixlWrapper", "name"),
    ("vllm.utils.network_utils", "make_zmq_path", "name"),
    # stats.py
    (f"{NIXL}.stats", "NixlKVConnectorStats.reset", "method"),
    (f"{NIXL}.stats", "NixlKVConnectorStats.is_empty", "method"),
    (f"{NIXL}.stats", "NixlKVConnectorStats.aggregate", "method"),
    (f"{NIXL}.stats", "NixlKVConnectorStats.reduce", "method"),
    (f"{NIXL}.stats", "NixlKVConnectorStats.clone_and_reset", "method"),
    (f"{NIXL}.stats", "NixlKVConnectorStats.__post_init__", "method"),
    (f"{NIXL}.stats", "NixlKVConnectorStats.data", "attr"),
    (f"{NIXL}.stats", "NixlPromMetrics.__init__", "method"),
    (f"{NIXL}.stats", "NixlPromMetrics.observe", "method"),
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
