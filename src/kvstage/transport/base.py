"""Transport contract: host-to-host READs of descriptor lists, with notifications.

A descriptor list is a numpy int64 array of shape ``[N, 2]``, one row per contiguous
byte range: ``(addr, nbytes)``. A READ pulls ``remote[i]`` from the peer into
``local[i]`` for every ``i``; both lists have the same ``N`` and the same ``nbytes``
per row. Addresses must lie inside memory the owner registered (``register``) once at
start-up: registration pins pages and builds remote keys, far too slow per request.

Nothing here imports NIXL or torch; ``kvstage.transport.nixl`` is the one module that
imports NIXL.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import numpy as np

from kvstage.errors import TransportFailure

if TYPE_CHECKING:
    import torch

__all__ = [
    "ClosingContext",
    "MemoryRegion",
    "Transport",
    "TransferState",
    "TransportError",
    "check_desc_array",
    "check_new_region",
    "tensor_region",
    "validate_descs",
    "validate_read",
    "wait",
]

# Regions listed in an error message; a host buffer is one region per physical tensor
# or one slab, so a handful is typical and 8 keeps the message readable.
_MAX_REGIONS_SHOWN = 8


class TransferState(enum.Enum):
    """State of one READ: ``PENDING`` until it ends ``DONE`` or ``FAILED``."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


#: The transport (or the peer behind it) refused or lost a request (`errors.TransportFailure`).
TransportError = TransportFailure


@dataclass(frozen=True)
class MemoryRegion:
    """A registered host byte range ``[addr, addr + nbytes)``."""

    addr: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


def check_desc_array(descs: object, what: str) -> np.ndarray:
    """Check that ``descs`` is an int64 ``[N, 2]`` array of ``(addr, nbytes)`` rows.

    Returns it unchanged; raises TypeError/ValueError naming ``what`` otherwise.
    """
    if not isinstance(descs, np.ndarray):
        raise TypeError(
            f"{what} descriptors must be a numpy int64 array of shape [N, 2] (addr, nbytes); "
            f"got {type(descs).__name__}. Build them with np.asarray(rows, dtype=np.int64)."
        )
    if descs.ndim != 2 or descs.shape[1] != 2 or descs.dtype != np.int64:
        raise ValueError(
            f"{what} descriptors must be int64 of shape [N, 2] (addr, nbytes); got dtype "
            f"{descs.dtype} shape {list(descs.shape)}. Convert with "
            f"np.asarray(descs, dtype=np.int64).reshape(-1, 2)."
        )
    return descs


def _describe(regions: list[MemoryRegion]) -> str:
    shown = ", ".join(f"[{r.addr:#x}, +{r.nbytes})" for r in regions[:_MAX_REGIONS_SHOWN])
    more = len(regions) - _MAX_REGIONS_SHOWN
    return shown + (f" and {more} more" if more > 0 else "") if regions else "none"


def validate_descs(descs: object, regions: list[MemoryRegion], what: str) -> np.ndarray:
    """Check every row of ``descs`` ([N, 2] int64) lies entirely inside one region.

    Vectorised: one ``np.searchsorted`` over the sorted region starts, not a Python loop
    per descriptor (a list has as many rows as a request has blocks). Regions must not
    overlap (``check_new_region`` enforces that at registration). Returns ``descs``.
    """
    descs = check_desc_array(descs, what)
    if len(descs) == 0:
        return descs
    addr, nbytes = descs[:, 0], descs[:, 1]
    bad = np.flatnonzero(nbytes <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{what} descriptor {i} has nbytes={int(nbytes[i])} ({bad.size} of {len(descs)} "
            f"descriptors are empty or negative); every descriptor must cover >= 1 byte. "
            f"Drop empty ranges before building the list."
        )
    ordered = sorted(regions, key=lambda r: r.addr)
    if ordered:
        starts = np.array([r.addr for r in ordered], dtype=np.int64)
        ends = np.array([r.end for r in ordered], dtype=np.int64)
        # The candidate region is the last one starting at or before addr.
        idx = np.searchsorted(starts, addr, side="right") - 1
        safe = np.maximum(idx, 0)
        # Compare nbytes <= end - addr, not addr + nbytes <= end: with nbytes near 2**63
        # the sum wraps negative in int64 and would pass; the difference cannot wrap.
        inside = (idx >= 0) & (nbytes <= ends[safe] - addr)
    else:
        inside = np.zeros(len(descs), dtype=bool)
    bad = np.flatnonzero(~inside)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{what} descriptor {i} (addr={int(addr[i]):#x}, nbytes={int(nbytes[i])}) is not "
            f"inside any registered region ({bad.size} of {len(descs)} descriptors are "
            f"outside); registered {what} regions: {_describe(ordered)}. Build descriptors "
            f"from a buffer passed to register()/register_tensor() and keep every range "
            f"inside it."
        )
    return descs


def validate_read(local: object, remote: object) -> int:
    """Check the pairing of a READ: same N >= 1 and same nbytes row by row.

    Only shapes are checked here; region checks are the caller's (local side) and the
    transport's (remote side). Returns N.
    """
    local = check_desc_array(local, "local")
    remote = check_desc_array(remote, "remote")
    if len(local) != len(remote):
        raise ValueError(
            f"a READ pairs local and remote descriptors row by row; got {len(local)} local "
            f"and {len(remote)} remote descriptors. Pass lists of the same length."
        )
    if len(local) == 0:
        raise ValueError("a READ needs at least one descriptor; got 0. Skip empty requests.")
    bad = np.flatnonzero(local[:, 1] != remote[:, 1])
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"descriptor {i} has local nbytes={int(local[i, 1])} but remote "
            f"nbytes={int(remote[i, 1])} ({bad.size} of {len(local)} pairs differ); each "
            f"pair must have the same length. Split or merge ranges identically on both sides."
        )
    return len(local)


def check_new_region(addr: int, nbytes: int, regions: list[MemoryRegion]) -> MemoryRegion:
    """Validate a registration request: positive ints, no overlap with ``regions``."""
    if not isinstance(addr, int) or not isinstance(nbytes, int):
        raise TypeError(f"register(addr, nbytes) takes ints; got {type(addr)}, {type(nbytes)}")
    if addr <= 0 or nbytes <= 0:
        raise ValueError(
            f"register() needs addr > 0 and nbytes > 0; got addr={addr:#x}, nbytes={nbytes}. "
            f"Register a real, non-empty host buffer."
        )
    new = MemoryRegion(addr, nbytes)
    for r in regions:
        if new.addr < r.end and r.addr < new.end:
            raise ValueError(
                f"region [{addr:#x}, +{nbytes}) overlaps registered region "
                f"[{r.addr:#x}, +{r.nbytes}); register each host buffer once, at start-up."
            )
    return new


def tensor_region(t: torch.Tensor) -> tuple[int, int]:
    """``(addr, nbytes)`` of a contiguous, non-empty CPU tensor; ValueError otherwise."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        raise ValueError(
            f"register_tensor() needs a contiguous, non-empty CPU tensor; got device="
            f"{t.device}, contiguous={t.is_contiguous()}, numel={t.numel()}. Register the "
            f"host buffer itself (e.g. the storage of a HostBuffer), not a view of it."
        )
    return t.data_ptr(), t.numel() * t.element_size()


@runtime_checkable
class Transport(Protocol):
    """Host-to-host READ transport between named agents. Not thread-safe: one owner."""

    name: str
    #: True when bytes a peer READs from us move only inside our own calls (a NIXL agent
    #: without its progress thread): the owner must call in often while it is read from
    progress_by_caller: bool

    def register(self, addr: int, nbytes: int) -> MemoryRegion:
        """Register ``[addr, addr + nbytes)`` once at start-up (before ``metadata()``)."""
        ...

    def metadata(self) -> bytes:
        """What a peer passes to ``add_peer`` to reach us, including our registrations."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's ``metadata()``; returns the peer's name for ``read``."""
        ...

    def remove_peer(self, name: str) -> None: ...

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> int:
        """Start READ of ``remote`` ([N, 2] on ``peer``) into ``local`` ([N, 2]).

        ``notif`` reaches the peer's ``get_notifs`` when the READ completes. Returns a
        handle id for ``poll``/``release``.
        """
        ...

    def poll(self, handle: int) -> TransferState:
        """Current state of ``handle``; never blocks."""
        ...

    def failure_reason(self, handle: int) -> str | None:
        """Why ``handle`` failed, in the transport's words (None while not failed)."""
        ...

    def release(self, handle: int) -> None:
        """Free ``handle``; `InvalidRequest` (a ValueError) if it is unknown (e.g. released
        twice), `TransportFailure` if the transport cannot release it yet."""
        ...

    def send_notif(self, peer: str, msg: bytes) -> None: ...

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Drain notifications received so far as ``(peer name, message)`` pairs."""
        ...

    @property
    def num_open_handles(self) -> int: ...

    def close(self) -> None:
        """Release handles, deregister memory, drop peers. Idempotent."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class ClosingContext:
    """Context-manager support for transports: ``with T(...) as t:`` closes on exit."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def wait(
    transport: Transport, handle: int, timeout_s: float, poll_interval_s: float = 0.0005
) -> TransferState:
    """Poll ``handle`` until it leaves PENDING or ``timeout_s`` passes.

    Returns the final state, or PENDING on timeout (never hangs: a peer that dies
    without the transport noticing leaves a READ PENDING forever). The default 0.5 ms
    interval adds at most 0.5 ms to the observed latency, while sleeping instead of
    spinning frees the core.
    """
    if timeout_s < 0 or poll_interval_s < 0:
        raise ValueError(
            f"wait() needs timeout_s >= 0 and poll_interval_s >= 0; got {timeout_s}, "
            f"{poll_interval_s}"
        )
    deadline = time.monotonic() + timeout_s
    while True:
        state = transport.poll(handle)
        remaining = deadline - time.monotonic()
        if state is not TransferState.PENDING or remaining <= 0:
            return state
        time.sleep(min(poll_interval_s, remaining))
