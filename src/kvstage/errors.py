"""kvstage's exceptions: one base class, the few kinds a caller acts on, each with a code.

Callers (the CLI, the benches, an engine's connector) branch on the class or on
``code``, never on message text: messages are for people and may be reworded. The
side channel's ``Error`` message carries the same ``code``, so a decode can tell
"not held" from "protocol mismatch" across the wire (`from_code` rebuilds the class).

Each kind also derives from the builtin a caller would naturally catch
(``ValueError`` for bad input, ``RuntimeError`` for a failed transport,
``TimeoutError`` for a missing answer), so ``except ValueError`` keeps working.
"""

from __future__ import annotations

from typing import ClassVar


class KVStageError(Exception):
    """Base of every error kvstage raises on purpose. ``code`` is stable; text is not."""

    code: ClassVar[str] = "error"


class LayoutMismatch(KVStageError, ValueError):
    """Two layouts (prefill vs decode, cache vs host, ids vs layout) do not fit."""

    code = "layout_mismatch"


class ProtocolMismatch(KVStageError, ValueError):
    """The peer speaks another side-channel protocol, or is not kvstage at all."""

    code = "protocol_mismatch"


class PoolExhausted(KVStageError, ValueError):
    """Not enough free blocks (or host rows) for the request."""

    code = "pool_exhausted"


class NotHeld(KVStageError, ValueError):
    """The request is not held (never saved, already read, released or expired)."""

    code = "not_held"


class InvalidRequest(KVStageError, ValueError):
    """A request's own fields are wrong (ids, sizes, a duplicate id)."""

    code = "invalid_request"


class Unauthorized(KVStageError, PermissionError):
    """A message without a valid key or capability: refused, nothing changed."""

    code = "unauthorized"


class TransportFailure(KVStageError, RuntimeError):
    """The transport (or the peer behind it) refused or lost a transfer."""

    code = "transport_failure"


class HandshakeTimeout(KVStageError, TimeoutError):
    """The peer's side channel did not answer within the timeout."""

    code = "handshake_timeout"


class PeerUnavailable(KVStageError, ConnectionError):
    """The peer cannot be reached at all (refused, unreachable, unresolvable)."""

    code = "peer_unavailable"


class PeerError(KVStageError, RuntimeError):
    """The peer answered with an error; ``remote_code`` says which kind."""

    code = "peer_error"

    def __init__(self, message: str, remote_code: str = "error") -> None:
        super().__init__(message)
        self.remote_code = remote_code


KINDS: dict[str, type[KVStageError]] = {
    cls.code: cls
    for cls in (
        KVStageError, LayoutMismatch, ProtocolMismatch, PoolExhausted, NotHeld,
        InvalidRequest, Unauthorized, TransportFailure, HandshakeTimeout, PeerUnavailable,
        PeerError,
    )
}


def code_of(exc: BaseException) -> str:
    """The wire code for ``exc``: its kind's code, or ``invalid_request`` for other
    ValueErrors (bad input reported by torch/numpy/msgspec), else ``error``."""
    if isinstance(exc, KVStageError):
        return exc.code
    if isinstance(exc, (ValueError, TypeError)):
        return InvalidRequest.code
    return KVStageError.code
