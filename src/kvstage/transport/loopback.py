"""In-process transport for unit tests: agents in one process READ each other's memory.

Agents find each other through a module-level registry keyed by name, so
``metadata()`` is just the encoded name. A READ validates both sides against the
registered regions, copies each descriptor with ``ctypes.memmove`` and queues the
notification on the peer; it completes inside ``read`` but is only reported by
``poll`` (DONE at the first poll), so callers exercise their polling path.

Fault injection (constructor flags, tests only): ``fail_reads`` (FAILED, nothing
copied, no notification), ``drop_notifs`` (bytes move, notifications are lost),
``stall_reads`` (PENDING, nothing copied, until ``resume_reads()``: then the bytes land
and the READ is DONE, its notification sent; like UCX tcp with a SIGSTOPped peer, a
stalled READ still writes on resume even after its handle was released: late bytes).
The real transport is ``kvstage.transport.nixl``; this fake exists for faults, not to
stand in for it.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import TYPE_CHECKING

import numpy as np

from kvstage.errors import InvalidRequest
from kvstage.transport.base import (
    ClosingContext,
    MemoryRegion,
    TransferState,
    TransportError,
    check_new_region,
    tensor_region,
    validate_descs,
    validate_read,
)

if TYPE_CHECKING:
    import torch

__all__ = ["LoopbackTransport"]

_AGENTS: dict[str, LoopbackTransport] = {}


class LoopbackTransport(ClosingContext):
    """A ``Transport`` whose peers live in the same process."""

    def __init__(
        self,
        name: str,
        *,
        fail_reads: bool = False,
        drop_notifs: bool = False,
        stall_reads: bool = False,
    ) -> None:
        if not name:
            raise ValueError("LoopbackTransport needs a non-empty name")
        if name in _AGENTS:
            raise ValueError(
                f"a LoopbackTransport named {name!r} already exists in this process; "
                f"names are unique per process (close the old one or pick another name)"
            )
        self.name = name
        self.progress_by_caller = False  # a READ copies inside the reader's call
        self.fail_reads = fail_reads
        self.drop_notifs = drop_notifs
        self.stall_reads = stall_reads
        self._regions: list[MemoryRegion] = []
        self._tensors: list[torch.Tensor] = []  # keeps registered tensors alive
        self._peers: set[str] = set()
        self._states: dict[int, TransferState] = {}
        self._reasons: dict[int, str] = {}
        self._inbox: list[tuple[str, bytes]] = []
        # stalled READs: handle -> (target, local, remote, notif); released ones stay
        self._stalled: dict[int, tuple[LoopbackTransport, np.ndarray, np.ndarray, bytes]] = {}
        # prefill and decode may poll from different threads (soak, tests)
        self._inbox_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        _AGENTS[name] = self

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"transport {self.name!r} is closed")

    def register(self, addr: int, nbytes: int) -> MemoryRegion:
        self._check_open()
        region = check_new_region(addr, nbytes, self._regions)
        self._regions.append(region)
        return region

    def register_tensor(self, t: torch.Tensor) -> MemoryRegion:
        """Register a contiguous CPU tensor's bytes; the tensor is kept alive until close."""
        region = self.register(*tensor_region(t))
        self._tensors.append(t)
        return region

    @property
    def regions(self) -> list[MemoryRegion]:
        return list(self._regions)

    def metadata(self) -> bytes:
        self._check_open()
        return self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        self._check_open()
        name = bytes(metadata).decode()
        if name not in _AGENTS:
            raise ValueError(
                f"no LoopbackTransport named {name!r} in this process; pass the bytes "
                f"returned by that agent's metadata() (loopback peers share one process)"
            )
        self._peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self._check_open()
        if name not in self._peers:
            raise ValueError(f"unknown peer {name!r}; known peers: {sorted(self._peers)}")
        self._peers.remove(name)

    def _peer(self, name: str) -> LoopbackTransport:
        if name not in self._peers:
            raise ValueError(f"unknown peer {name!r}; call add_peer(its metadata()) first")
        peer = _AGENTS.get(name)
        if peer is None:
            raise TransportError(f"peer {name!r} was closed after add_peer; it is gone")
        return peer

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> int:
        """READ ``remote`` ([N, 2] on ``peer``) into ``local`` ([N, 2]); returns a handle."""
        self._check_open()
        target = self._peer(peer)
        validate_read(local, remote)
        validate_descs(local, self._regions, "local")
        validate_descs(remote, target._regions, f"remote (peer {peer!r})")
        handle = next(self._ids)
        if self.stall_reads:
            self._states[handle] = TransferState.PENDING
            self._stalled[handle] = (target, local.copy(), remote.copy(), bytes(notif))
        elif self.fail_reads:
            self._states[handle] = TransferState.FAILED
            self._reasons[handle] = "fail_reads=True (fault injection)"
        else:
            self._states[handle] = TransferState.PENDING
            self._complete(handle, target, local, remote, notif)
        return handle

    def _complete(self, handle: int, target: LoopbackTransport, local: np.ndarray,
                  remote: np.ndarray, notif: bytes) -> None:
        for (dst, nbytes), (src, _) in zip(local.tolist(), remote.tolist(), strict=True):
            ctypes.memmove(dst, src, nbytes)
        if handle in self._states:  # a released handle's bytes land all the same
            self._states[handle] = TransferState.DONE
        if notif and not self.drop_notifs:  # as NIXL: an empty notif_msg sends nothing
            target._deliver(self.name, bytes(notif))

    def resume_reads(self) -> int:
        """Complete every stalled READ now (released ones too); returns how many."""
        self._check_open()
        stalled, self._stalled = self._stalled, {}
        for handle, (target, local, remote, notif) in stalled.items():
            if not target._closed:
                self._complete(handle, target, local, remote, notif)
        return len(stalled)

    def poll(self, handle: int) -> TransferState:
        self._check_open()
        try:
            return self._states[handle]
        except KeyError:
            raise InvalidRequest(
                f"unknown handle {handle} (released, or not from read())"
            ) from None

    def failure_reason(self, handle: int) -> str | None:
        """Why ``handle`` FAILED, or None if it has not failed."""
        self.poll(handle)
        return self._reasons.get(handle)

    def release(self, handle: int) -> None:
        self._check_open()
        if self._states.pop(handle, None) is None:
            raise InvalidRequest(f"unknown handle {handle} (already released, or not from read())")
        self._reasons.pop(handle, None)

    def send_notif(self, peer: str, msg: bytes) -> None:
        self._check_open()
        target = self._peer(peer)
        if not self.drop_notifs:
            target._deliver(self.name, bytes(msg))

    def _deliver(self, sender: str, msg: bytes) -> None:
        with self._inbox_lock:
            self._inbox.append((sender, msg))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self._check_open()
        with self._inbox_lock:
            notifs, self._inbox = self._inbox, []
        return notifs

    @property
    def num_open_handles(self) -> int:
        return len(self._states)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._states.clear()
        self._reasons.clear()
        self._stalled.clear()
        self._regions.clear()
        self._tensors.clear()
        self._peers.clear()
        with self._inbox_lock:
            self._inbox.clear()
        if _AGENTS.get(self.name) is self:
            del _AGENTS[self.name]
