"""Host-to-host KV block transport: a small READ contract and its implementations.

``Transport`` (protocol), ``TransferState``, ``TransportError``, ``MemoryRegion``,
``validate_descs`` and ``wait`` live in ``base``; ``LoopbackTransport`` is the
in-process fake for tests. ``NixlTransport`` is imported lazily on attribute access
(``kvstage.transport.NixlTransport``) and only its constructor imports NIXL, so
importing this package never touches NIXL.
"""

from __future__ import annotations

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
    "LoopbackTransport",
    "MemoryRegion",
    "NixlTransport",
    "TransferState",
    "Transport",
    "TransportError",
    "default_ucx_env",
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
