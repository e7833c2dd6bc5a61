"""What the role commands need across machines: UCX settings from the address, a reachability
probe with a verdict a person can act on, and signals turned into a clean exit.

Used by ``kvstage prefill``, ``kvstage decode`` (``kvstage.cli.roles``) and
``python -m bench.transfer`` (the repository's bench/ folder); imports no NIXL.
"""

from __future__ import annotations

import contextlib
import errno
import signal
import socket
from collections.abc import Iterator
from types import FrameType

from kvstage.errors import (
    HandshakeTimeout,
    LayoutMismatch,
    PeerError,
    PeerUnavailable,
    ProtocolMismatch,
    TransportFailure,
)

EXIT_UNUSABLE_PEER = 2
PROBE_TIMEOUT_S = 3.0


def probe(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """TCP-connect to the side channel once, so refused and unreachable read differently."""
    where = f"{host}:{port}"
    fix = (f"check the address, that `kvstage prefill --listen {where}` runs there, and that "
           f"port {port}/tcp (and UCX's ports, docs/deploy.md 'Ports to open') is open between "
           "hosts")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except ConnectionRefusedError:
        raise PeerUnavailable(
            f"prefill at {where} refused the connection: nothing listens on port {port} "
            f"there (start `kvstage prefill --listen {where}` on that host, or fix the port)"
        ) from None
    except socket.gaierror as exc:
        raise PeerUnavailable(f"cannot resolve {host!r}: {exc}") from None
    except TimeoutError:
        raise PeerUnavailable(
            f"prefill at {where} is unreachable: no answer to a TCP connect within "
            f"{timeout_s:.0f} s (link down or packets dropped); {fix}"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL):
            raise PeerUnavailable(
                f"prefill at {where} is unreachable: {exc.strerror}; {fix}"
            ) from None
        raise PeerUnavailable(f"cannot connect to prefill at {where}: {exc}; {fix}") from None


def explain(exc: BaseException, where: str) -> str:
    """One line for a failed handshake with the prefill at ``where``: which failure, what to
    do. Decided on the error's class and code, never on its text."""
    text = str(exc)
    code = exc.remote_code if isinstance(exc, PeerError) else getattr(exc, "code", "")
    if isinstance(exc, HandshakeTimeout):
        return f"prefill at {where} accepted the connection but did not answer: {text}"
    if code == ProtocolMismatch.code:
        return (f"prefill at {where} speaks an incompatible version: {text}. Install the same "
                "kvstage version on both hosts")
    if code == LayoutMismatch.code:
        return (f"prefill at {where} has an incompatible layout: {text}. Start decode with the "
                "prefill's --preset, --num-blocks and --host-layout (its 'listening' line "
                "shows them)")
    if isinstance(exc, TransportFailure):
        return (f"NIXL/UCX cannot reach the prefill at {where}: {text}. The side channel "
                "answered, so check the UCX device and transports on both sides "
                "(--ucx-net-devices, --ucx-tls; across hosts: tcp on the interface that "
                "carries the address) and that UCX's TCP ports are open")
    if isinstance(exc, PeerError):
        return f"prefill at {where} refused the handshake: {text}"
    return f"cannot use prefill at {where}: {type(exc).__name__}: {text}"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised in the main thread so ``with`` blocks clean up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn the first SIGINT/SIGTERM into ``Interrupted``; a second one gets the default
    action (so a stuck clean-up can still be killed)."""
    sigs = (signal.SIGINT, signal.SIGTERM)

    def handler(signum: int, _frame: FrameType | None) -> None:
        for s in sigs:
            signal.signal(s, signal.SIG_DFL)
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
