"""Build a transport by name; NIXL is imported only when "nixl" is asked for."""

from __future__ import annotations

from typing import Any

from kvstage.transport.base import Transport

TRANSPORTS = ("nixl", "loopback")


def make_transport(kind: str, name: str, **options: Any) -> Transport:
    """``"nixl"``: a real NIXL/UCX agent; ``"loopback"``: in-process memcpy (tests)."""
    if kind == "nixl":
        from kvstage.transport.nixl import NixlTransport

        return NixlTransport(name, **options)
    if kind == "loopback":
        from kvstage.transport.loopback import LoopbackTransport

        return LoopbackTransport(name, **options)
    raise ValueError(f"unknown transport {kind!r}; choose one of {list(TRANSPORTS)}")
