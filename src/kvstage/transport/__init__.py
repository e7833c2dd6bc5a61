"""Host-to-host KV block transport: a small READ contract and its implementations.

``Transport`` (protocol), ``TransferState``, ``TransportError``, ``MemoryRegion``,
``validate_descs`` and ``wait`` live in ``base``; ``LoopbackTransport`` is the
in-process fake for tests. ``NixlTransport`` is imported lazily on attribute access
(``kvstage.transport.NixlTransport``) and only its constructor imports NIXL, so
importing this package never touches NIXL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstage.transport.base import (
    MemoryRegion,
    TransferState,
    Transport,
    TransportError,
    validate_descs,
    wait,
)
from kvstage.transport.loopback import LoopbackTransport

if TYPE_CHECKING:
    from kvstage.transport.nixl import NixlTransport, default_ucx_env

__all__ = [
    "TRANSPORTS",
    "LoopbackTransport",
    "MemoryRegion",
    "NixlTransport",
    "TransferState",
    "Transport",
    "TransportError",
    "default_ucx_env",
    "make_transport",
    "validate_descs",
    "wait",
]


def __getattr__(name: str) -> Any:
    # kvstage.transport.nixl imports no NIXL at module level either; deferring it keeps
    # `import kvstage.transport` to base + loopback.
    if name in ("NixlTransport", "default_ucx_env"):
        from kvstage.transport import nixl

        return getattr(nixl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _nixl(name: str, **options: Any) -> Transport:
    from kvstage.transport.nixl import NixlTransport

    return NixlTransport(name, **options)


#: name -> constructor; the CLI's --transport choices come from here
TRANSPORTS: dict[str, Callable[..., Transport]] = {
    "nixl": _nixl,  # a real NIXL/UCX agent (imports NIXL only when built)
    "loopback": LoopbackTransport,  # in-process memcpy with fault options (tests)
}


def make_transport(kind: str, name: str, **options: Any) -> Transport:
    """Build the transport registered as ``kind`` with agent name ``name``."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[kind](name, **options)
