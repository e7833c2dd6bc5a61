"""NIXL (UCX) transport: host-to-host READs between processes. The one NIXL import.

NIXL is imported when a ``NixlTransport`` is constructed, never at module import, so
``import kvstage.transport`` works without it.

UCX settings (``default_ucx_env``, applied with ``os.environ.setdefault`` before NIXL is
imported, so values already in the environment win): on loopback ``UCX_TLS=tcp,sm,self,
cma`` (the bytes move by CMA; tcp is needed for UCX's peer-failure detection) and
``UCX_NET_DEVICES=lo``. Across hosts the role commands choose with
`kvstage.transport.ucx_env` (tcp on the interface that carries the address). Why each
setting, and what was measured with it (bandwidth, failure latency, the link-cut
behaviour): BENCHMARKS.md "How fast is the READ?" and docs/deploy.md "UCX".

Contract: ``read`` may complete inside the call (CMA) or later (``poll``); a READ outside
the peer's registered memory fails in ``read``; a dead peer surfaces as a
`TransportFailure` from ``read`` or FAILED from ``poll``; memory registered after
``metadata()`` is invisible to a peer until it re-adds our metadata. Not thread-safe:
one owner thread.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any

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
from kvstage.transport.nixl_agent import (
    DEFAULT_PROGRESS_DELAY_US,
    check_progress_delay,
    create_agent,
)
from kvstage.transport.nixl_state import AgentState

if TYPE_CHECKING:
    import torch

__all__ = ["NixlTransport", "default_ucx_env"]

NIXL_MISSING = "NIXL is not installed: pip install 'kvstage[nixl]' (nixl-cu12==1.5.1)"
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.PENDING}


def default_ucx_env() -> dict[str, str]:
    """UCX environment for two processes on one host over loopback (see module doc)."""
    return {"UCX_TLS": "tcp,sm,self,cma", "UCX_NET_DEVICES": "lo"}


def _import_nixl(env: dict[str, str]) -> ModuleType:
    # UCX reads UCX_* when the backend is created; setting them before the import also
    # covers anything read at library load.
    for key, value in env.items():
        os.environ.setdefault(key, value)
    error: ImportError | None = None
    for module in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            error = e
    raise ImportError(f"{NIXL_MISSING}; last import error: {error}") from error


def _fail(what: str, e: Exception, hint: str) -> TransportError:
    return TransportError(f"{what}: {type(e).__name__}: {e}. {hint}")


class NixlTransport(ClosingContext):
    """A ``Transport`` over a NIXL agent with one backend (UCX by default).

    ``num_threads`` > 0 gives the UCX backend a thread pool that splits a descriptor
    list across threads (vLLM uses 4); 0 posts everything from the calling thread.
    Default 2 (the fastest of 0, 2 and 4 where it was measured: BENCHMARKS.md "How fast
    is the READ?"). ``ucx_env`` None means ``default_ucx_env()``;
    ``{}`` sets nothing. ``backend_params`` are passed to ``create_backend`` (e.g.
    ``{"ucx_error_handling_mode": "none"}``; see the module doc for why not).
    ``progress_delay_us``: the NIXL progress thread waits on UCX's event fd for up to
    this long between polls (nixl-cu12 1.5.1's wrapper sets 0, a busy loop: a core per
    idle agent; see `kvstage.transport.nixl_agent`); 0 restores NIXL's busy loop.
    ``progress_thread`` False: no NIXL progress thread; UCX then progresses only inside
    our calls (``poll``, ``get_notifs``, ``read``), so the owner must call one of them
    often while a peer READs from it.
    """

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        num_threads: int = 2,
        ucx_env: dict[str, str] | None = None,
        backend_params: dict[str, str] | None = None,
        progress_thread: bool = True,
        progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US,
    ) -> None:
        if not name:
            raise ValueError("NixlTransport needs a non-empty, per-process unique name")
        if num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: no thread pool); got {num_threads}")
        check_progress_delay(progress_delay_us)
        api = _import_nixl(default_ucx_env() if ucx_env is None else dict(ucx_env))
        params = dict(backend_params or {})
        if num_threads > 0:
            params["num_threads"] = str(num_threads)
        try:
            # backends=[] then create_backend: nixl_agent skips a missing plugin with only
            # a warning, create_backend raises.
            agent = create_agent(api, name, progress_thread=progress_thread,
                                 delay_us=progress_delay_us)
            agent.create_backend(backend, params)
        except Exception as e:
            env = {k: os.environ.get(k) for k in ("UCX_TLS", "UCX_NET_DEVICES")}
            raise _fail(
                f"could not create NIXL agent {name!r} with backend {backend} {params}",
                e,
                f"With UCX the transports must include tcp (peer failure detection); "
                f"environment now: {env}. See kvstage.transport.nixl.default_ucx_env().",
            ) from e
        self.name = name
        self.backend = backend
        self.progress_by_caller = not progress_thread
        self._state = AgentState(agent)
        self._ids = itertools.count(1)
        self._finalizer = weakref.finalize(self, AgentState.close, self._state)

    def _open(self) -> AgentState:
        if self._state.closed:
            raise TransportError(f"transport {self.name!r} is closed")
        return self._state

    def register(self, addr: int, nbytes: int) -> MemoryRegion:
        """Register host memory as DRAM (device id 0). Call before ``metadata()``."""
        st = self._open()
        region = check_new_region(addr, nbytes, st.regions)
        try:
            reg = st.agent.get_reg_descs([(addr, nbytes, 0, "")], "DRAM")
            st.agent.register_memory(reg)
        except Exception as e:
            raise _fail(
                f"NIXL could not register [{addr:#x}, +{nbytes})",
                e,
                "Check that the range is mapped host memory of this process.",
            ) from e
        st.reg_dlists.append(reg)
        st.regions.append(region)
        return region

    def register_tensor(self, t: torch.Tensor) -> MemoryRegion:
        """Register a contiguous CPU tensor's bytes; the tensor is kept alive until close."""
        region = self.register(*tensor_region(t))
        self._state.tensors.append(t)
        return region

    @property
    def regions(self) -> list[MemoryRegion]:
        return list(self._state.regions)

    def metadata(self) -> bytes:
        """NIXL agent metadata (~450 bytes + registrations) for the peer's ``add_peer``."""
        return bytes(self._open().agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        st = self._open()
        if not isinstance(metadata, bytes | bytearray | memoryview):
            raise TypeError(f"add_peer() takes the peer's metadata() bytes; got {type(metadata)}")
        known = st.peer_meta.get(bytes(metadata))
        if known in st.peers:
            # loading an agent again invalidates its in-flight READs in NIXL (their state
            # turns NIXL_ERR_NOT_FOUND while UCX may still write): a re-handshake with the
            # same agent must not, or a quarantined READ would look over
            return known
        try:
            name = st.agent.add_remote_agent(bytes(metadata))
        except Exception as e:
            raise _fail(
                "NIXL could not load peer metadata",
                e,
                "Pass the peer's metadata() bytes unchanged (NIXL_ERR_MISMATCH means "
                "they are not NIXL agent metadata or come from another NIXL version; "
                "NIXL_ERR_BACKEND with 'Destination is unreachable' logged means no UCX "
                "device here reaches the peer's: set UCX_NET_DEVICES/UCX_TLS, see "
                "kvstage.transport.ucx_env).",
            ) from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        st.peers.add(name)
        st.peer_meta[bytes(metadata)] = name
        return name

    def remove_peer(self, name: str) -> None:
        st = self._check_peer(name)
        st.peers.remove(name)
        try:
            st.agent.remove_remote_agent(name)
        except Exception as e:
            raise _fail(f"NIXL could not remove peer {name!r}", e, "It is forgotten anyway.") from e

    def _check_peer(self, peer: str) -> AgentState:
        st = self._open()
        if peer not in st.peers:
            raise ValueError(
                f"unknown peer {peer!r}; call add_peer(its metadata()) first "
                f"(known peers: {sorted(st.peers)})"
            )
        return st

    def _dlist(self, descs: np.ndarray) -> Any:
        # NIXL takes C-contiguous [N, 3] (addr, nbytes, dev id); building it costs ~1 ms
        # per 100k descriptors, negligible next to the transfer.
        rows = np.zeros((len(descs), 3), dtype=np.int64)
        rows[:, :2] = descs
        dlist = self._state.agent.get_xfer_descs(rows, "DRAM")
        if dlist is None:
            raise TransportError(f"NIXL rejected a descriptor array of shape {rows.shape}")
        return dlist

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> int:
        """Start a READ of ``remote`` ([N, 2] int64 on ``peer``) into ``local`` ([N, 2]).

        ``notif`` reaches the peer when the READ completes. Local descriptors are
        checked here; remote ones by NIXL against the peer's registration.
        """
        st = self._check_peer(peer)
        n = validate_read(local, remote)
        validate_descs(local, st.regions, "local")
        if not isinstance(notif, bytes):
            raise TypeError(f"notif must be bytes; got {type(notif).__name__}")
        what = f"READ of {n} descriptors ({int(local[:, 1].sum())} bytes) from peer {peer!r}"
        try:
            xfer = st.agent.initialize_xfer(
                "READ", self._dlist(local), self._dlist(remote), peer, notif
            )
        except Exception as e:
            raise _fail(
                f"NIXL refused the {what}",
                e,
                "NIXL_ERR_NOT_FOUND means a remote descriptor is outside the memory the "
                "peer registered before producing the metadata given to add_peer "
                "(re-add the peer after it registers more).",
            ) from e
        return self._post(st, xfer, what)

    def _post(self, st: AgentState, xfer: Any, what: str) -> int:
        try:
            status = st.agent.transfer(xfer)
        except Exception as e:
            with contextlib.suppress(Exception):  # the post error is the one to report
                st.agent.release_xfer_handle(xfer)
            raise _fail(
                f"NIXL failed to post the {what}",
                e,
                "NIXL_ERR_REMOTE_DISCONNECT means the peer process died or closed: "
                "handshake again with a live peer.",
            ) from e
        handle = next(self._ids)
        st.xfers[handle] = xfer
        if status not in _STATES:
            st.final[handle] = TransferState.FAILED
            st.reasons[handle] = f"transfer() returned {status!r}"
        return handle

    def prepare(self, peer: str | None, descs: np.ndarray) -> int:
        """Prepare a descriptor list once (NIXL ``prep_xfer_dlist``): ours (``peer`` None,
        checked against our registrations) or ``peer``'s. Returns an id for
        ``read_prepared``; kept until close. Per request, a READ then names rows of two
        prepared lists by index instead of building and checking descriptor lists."""
        st = self._open() if peer is None else self._check_peer(peer)
        if peer is None:
            validate_descs(descs, st.regions, "local")
        rows = np.zeros((len(descs), 3), dtype=np.int64)
        rows[:, :2] = descs
        try:
            prep = st.agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", rows, "DRAM")
        except Exception as e:
            raise _fail("NIXL could not prepare a descriptor list", e,
                        "Remote rows must lie in memory the peer registered.") from e
        key = next(self._ids)
        st.preps[key] = prep
        return key

    def read_prepared(self, peer: str, local: int, local_idx: np.ndarray, remote: int,
                      remote_idx: np.ndarray, notif: bytes) -> int:
        """Like ``read`` over rows ``local_idx`` of prepared list ``local`` and
        ``remote_idx`` of ``remote`` (``make_prepped_xfer``; NIXL merges adjacent rows)."""
        st = self._check_peer(peer)
        try:
            xfer = st.agent.make_prepped_xfer(
                "READ", st.preps[local], np.asarray(local_idx, dtype=np.int32),
                st.preps[remote], np.asarray(remote_idx, dtype=np.int32), notif)
        except KeyError:
            raise InvalidRequest(f"unknown prepared list {local} or {remote}") from None
        except Exception as e:
            raise _fail(f"NIXL refused a prepared READ from peer {peer!r}", e,
                        "Indices must lie inside the prepared lists.") from e
        return self._post(st, xfer, f"prepared READ of {len(local_idx)} rows from {peer!r}")

    def _xfer(self, handle: int) -> tuple[AgentState, Any]:
        st = self._open()
        xfer = st.xfers.get(handle)
        if xfer is None:
            raise InvalidRequest(f"unknown handle {handle} (already released, or not from read())")
        return st, xfer

    def poll(self, handle: int) -> TransferState:
        st, xfer = self._xfer(handle)
        if handle in st.final:
            return st.final[handle]
        try:
            status = st.agent.check_xfer_state(xfer)
        except Exception as e:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the peer died mid-READ
            status = f"{type(e).__name__}: {e}"
        state = _STATES.get(status, TransferState.FAILED)
        if state is not TransferState.PENDING:
            st.final[handle] = state
            if state is TransferState.FAILED:
                st.reasons[handle] = status
        return state

    def failure_reason(self, handle: int) -> str | None:
        """Why ``handle`` FAILED (NIXL's status or error), or None if it has not failed."""
        st, _ = self._xfer(handle)
        return st.reasons.get(handle)

    def release(self, handle: int) -> None:
        st, xfer = self._xfer(handle)
        try:
            st.agent.release_xfer_handle(xfer)
        except Exception as e:
            raise _fail(
                f"NIXL could not release handle {handle}",
                e,
                "It may be in flight and not cancellable: poll() until it is not "
                "PENDING and release again (close() drops it regardless).",
            ) from e
        del st.xfers[handle]
        st.final.pop(handle, None)
        st.reasons.pop(handle, None)

    def send_notif(self, peer: str, msg: bytes) -> None:
        st = self._check_peer(peer)
        try:
            st.agent.send_notif(peer, msg)
        except Exception as e:
            raise _fail(f"NIXL could not notify peer {peer!r}", e, "Is the peer alive?") from e

    def get_notifs(self) -> list[tuple[str, bytes]]:
        st = self._open()
        try:
            by_peer = st.agent.get_new_notifs()
        except Exception as e:
            raise _fail("NIXL could not fetch notifications", e, "The agent may be broken.") from e
        return [(str(p), bytes(m)) for p, msgs in by_peer.items() for m in msgs]

    @property
    def num_open_handles(self) -> int:
        return len(self._state.xfers)

    def close(self) -> None:
        self._finalizer()
