"""DecodeWorker: the decode role. Handshake, READ host -> host over NIXL, then h2d.

Primitives (what an engine calls):
- ``start(request_id, remote_addr, remote_block_ids, local_block_ids, capability=)``:
  handshake once per remote (authenticated with ``key``), confirm the remote lease with
  the request's capability (from prefill's PrefillDone), pair remote and local ids, merge
  the pairs into runs (`pair_runs`) and post ONE READ whose descriptors are one per run
  (block-major host) or one per run per tensor per plane (mirror).
- ``poll()``: never blocks; a DONE READ is loaded to the device (h2d) and reported
  ``done``; a FAILED or timed-out one is reported ``failed`` with the transport's reason.
- ``abort(request_id)``: stop waiting for a request and ask the prefill to release it.
- ``finish(request_id)``: the caller is done with a request whose local ids the worker
  allocated from its pool.

Who owns what: the engine owns the device tensors (`KVCache.wrap`) and, when it passes
``local_block_ids``, those ids: the worker refuses ids another in-flight request holds,
and ids its own pool has not allocated. Without ``local_block_ids`` the worker's
``pool`` allocates them. The worker owns the host buffer (one registered allocation)
and the injected `Transport`, which `close` closes. A handle the transport will not
release yet keeps its local ids in flight (``num_draining``) until it can be released.

Thread rules: one thread calls every method (NIXL agents are not guaranteed
thread-safe).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence

import numpy as np

from kvstage.blocks import BlockPool, GroupedBlockIds
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.engine import CopyEngine
from kvstage.errors import (
    InvalidRequest,
    KVStageError,
    LayoutMismatch,
    PeerError,
    PoolExhausted,
    ProtocolMismatch,
    TransportFailure,
    code_of,
)
from kvstage.pd import auth
from kvstage.pd import messages as m
from kvstage.pd.reads import (  # noqa: F401  (re-exported: the role's public names)
    ABORTED,
    DEFAULT_READ_TIMEOUT_S,
    READ_FAILED,
    READ_TIMEOUT,
    Remote,
    RequestResult,
    _Pending,
    pair_runs,
)
from kvstage.pd.side_channel import DEFAULT_TIMEOUT_S, SideChannelClient
from kvstage.transport.base import TransferState, Transport


def _finite_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        0 < value < float("inf")
    ):
        raise InvalidRequest(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


class DecodeWorker:
    def __init__(
        self,
        cache: KVCache,
        transport: Transport,
        *,
        host_layout: HostLayout = HostLayout.BLOCK_MAJOR,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        handshake_timeout_s: float = DEFAULT_TIMEOUT_S,
        engine_id: str | None = None,
        pool: BlockPool | None = None,
        key: bytes | None = None,
    ) -> None:
        try:
            self.key = key  # the side channel's shared key (`kvstage.pd.auth`), or None
            self.read_timeout_s = _finite_positive("read_timeout_s", read_timeout_s)
            self.handshake_timeout_s = _finite_positive("handshake_timeout_s",
                                                        handshake_timeout_s)
            self.layout = cache.layout
            self.engine_id = engine_id or f"decode-{uuid.uuid4().hex[:8]}"
            self.cache = cache
            self.pool = pool
            self.host = HostBuffer.for_device(self.layout, cache.device, host_layout)
            self.engine = CopyEngine(cache, self.host)
            self.transport = transport
            self.transport.register(self.host.data_ptr, self.host.nbytes)
        except Exception:
            transport.close()
            raise
        self._remotes: dict[tuple[str, int], Remote] = {}
        self._pending: dict[str, _Pending] = {}
        self._owned: dict[str, list[list[int]]] = {}  # request -> local ids we allocated
        self._draining: dict[int, list[list[int]]] = {}  # handle -> blocks held back
        self._in_flight: dict[int, str] = {}  # local block id -> request (or handle) using it
        self._closed = False

    # -- handshake ----------------------------------------------------------------------
    def client(self, host: str, port: int) -> SideChannelClient:
        return SideChannelClient(host, port, timeout_s=self.handshake_timeout_s, key=self.key)

    def connect(self, host: str, port: int) -> Remote:
        """Handshake once per remote: fetch its agent metadata and layout, check both."""
        key = (host, port)
        if key in self._remotes:
            return self._remotes[key]
        meta = self.client(host, port).call(m.GetMeta(engine_id=self.engine_id))
        if not isinstance(meta, m.Meta):
            raise ProtocolMismatch(
                f"{host}:{port} answered GetMeta with {type(meta).__name__}"
            )
        remote_layout = m.layout_from_msg(meta.layout)
        try:
            self.layout.check_compatible(remote_layout)
        except ValueError as exc:
            raise LayoutMismatch(str(exc)) from None
        if meta.host_layout != self.host.host_layout.value:
            raise LayoutMismatch(
                f"incompatible host buffer: host_layout is {self.host.host_layout.value!r} "
                f"here, {meta.host_layout!r} remote; start both sides with the same one"
            )
        if self.read_timeout_s >= meta.lease_s:
            raise InvalidRequest(
                f"read_timeout_s ({self.read_timeout_s}) must be below the prefill lease "
                f"({meta.lease_s} s), else a READ could outlive the blocks it reads"
            )
        try:
            peer = self.transport.add_peer(meta.agent_metadata)
        except KVStageError:
            raise
        except Exception as exc:  # e.g. a loopback decode given a NIXL prefill's metadata
            raise ProtocolMismatch(
                f"cannot use the agent metadata of {host}:{port} with this decode's "
                f"{type(self.transport).__name__}: {type(exc).__name__}; run both sides "
                "with the same --transport"
            ) from None
        remote = Remote(
            host, port, meta.engine_id, peer, remote_layout, self.host.host_layout,
            meta.host_base, meta.lease_s,
        )
        self._remotes[key] = remote
        return remote

    # -- requests ---------------------------------------------------------------------------
    def _claim_local(
        self, remote_ids: Sequence[Sequence[int]],
        local_block_ids: Sequence[Sequence[int]] | None,
    ) -> tuple[list[list[int]], bool]:
        """The request's local ids, checked: (ids, allocated here)."""
        if local_block_ids is None:
            if self.pool is None:
                raise InvalidRequest(
                    "local_block_ids is required: this decode worker has no BlockPool "
                    "(the engine allocates the ids)"
                )
            counts = [len(g) for g in remote_ids]
            if sum(counts) > self.pool.num_free:
                raise PoolExhausted(
                    f"request needs {sum(counts)} local blocks, {self.pool.num_free} are free"
                )
            return [self.pool.allocate(n) for n in counts], True
        local = [list(g) for g in local_block_ids]
        GroupedBlockIds(local, self.layout)  # shape, range and duplicate checks
        pair_runs(remote_ids, local)  # pairing checks before ownership checks
        busy = sorted({b for g in local for b in g if b and b in self._in_flight})
        if busy:
            raise InvalidRequest(
                f"local blocks {busy[:8]} are in flight for request "
                f"{self._in_flight[busy[0]]!r}; a block may receive one READ at a time"
            )
        if self.pool is not None:
            free = sorted({b for g in local for b in g if b and self.pool.is_free(b)})
            if free:
                raise InvalidRequest(
                    f"local blocks {free[:8]} were not allocated from this worker's pool "
                    "(it would hand them out again); allocate them from decode.pool first"
                )
        return local, False

    def start(
        self,
        request_id: str,
        remote_addr: tuple[str, int],
        remote_block_ids: Sequence[Sequence[int]],
        local_block_ids: Sequence[Sequence[int]] | None = None,
        *,
        remote_request_id: str | None = None,
        capability: bytes = b"",
    ) -> RequestResult:
        """Post the READ for one request; returns its (pending or failed) result.
        ``capability``: the token prefill issued with the ids (``PrefillDone.capability``);
        without it prefill refuses the Acquire and the request fails "unauthorized"."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._pending or request_id in self._owned:
            raise InvalidRequest(
                f"request id {request_id!r} is already in flight here; finish or abort it "
                "first, or use a new id"
            )
        remote_rid = remote_request_id or request_id
        GroupedBlockIds(remote_block_ids, self.layout)  # validates before anything happens
        local, allocated = self._claim_local(remote_block_ids, local_block_ids)
        try:
            runs = pair_runs(remote_block_ids, local)
        except (ValueError, TypeError):
            if allocated:
                self._free_blocks(local)
            raise
        if allocated:
            self._owned[request_id] = local
        result = RequestResult(request_id, "pending", local_block_ids=local)
        result.num_runs = int(runs.shape[0])
        result.nbytes = int(runs[:, 2].sum()) * self.layout.block_bytes if runs.size else 0
        try:
            remote = self.connect(*remote_addr)
            if runs.shape[0] == 0:
                return self._finish(result, None)
            lease = self.client(*remote_addr).call(
                m.Acquire(request_id=remote_rid, capability=capability)
            )
            if not isinstance(lease, m.Lease):
                raise ProtocolMismatch(
                    f"unexpected answer to Acquire: {type(lease).__name__}"
                )
            local_d = self.host.descriptors(runs[:, 1], runs[:, 2])
            remote_d = self._remote_descs(remote, runs)
            result.num_descriptors = int(local_d.shape[0])
            started = time.monotonic()
            handle = self.transport.read(remote.peer, local_d, remote_d,
                                         auth.completion_notif(remote_rid, capability))
        except Exception as exc:  # every failure ends as a failed request, never a crash
            if isinstance(exc, TransportFailure):
                self._forget((remote_addr[0], remote_addr[1]))
            code = exc.remote_code if isinstance(exc, PeerError) else code_of(exc)
            return self._fail(result, f"{type(exc).__name__}: {exc}", code=code)
        budget = min(self.read_timeout_s, lease.remaining_s)
        self._pending[request_id] = _Pending(
            result, remote, remote_rid, handle, started, started + budget, capability
        )
        for g in local:
            for b in g:
                if b:
                    self._in_flight[b] = request_id
        return result

    def _remote_descs(self, remote: Remote, runs: np.ndarray) -> np.ndarray:
        # the remote buffer has our layout (checked at handshake): shift addresses only
        local = self.host.descriptors(runs[:, 0], runs[:, 2])
        local[:, 0] += remote.base - self.host.data_ptr
        return local

    def poll(self) -> list[RequestResult]:
        """Advance every pending READ without blocking; returns requests that ended."""
        self._retry_draining()
        ended = []
        now = time.monotonic()
        for rid, p in list(self._pending.items()):
            try:
                state = self.transport.poll(p.handle)
            except Exception as exc:
                state, why, code = TransferState.FAILED, f"poll failed: {exc}", READ_FAILED
            else:
                code = READ_FAILED
                why = self.transport.failure_reason(p.handle) or (
                    "the transport reported the READ failed (peer gone or remote memory "
                    "invalid)"
                )
            if state is TransferState.PENDING and now < p.deadline:
                continue
            del self._pending[rid]
            p.result.read_s = now - p.started
            if state is TransferState.DONE:
                self._release(p.handle, None, p.result.local_block_ids)
                ended.append(self._finish(p.result, p))
            else:
                if state is TransferState.PENDING:
                    why = f"READ timed out after {now - p.started:.2f} s"
                    code = READ_TIMEOUT
                self._forget((p.remote.host, p.remote.port), p.remote)
                ended.append(self._fail(p.result, why, handle=p.handle, code=code))
        return ended

    def _forget(self, key: tuple[str, int], remote: Remote | None = None) -> None:
        """Drop a cached handshake after a READ failed in the transport: the prefill may
        have restarted on the same address with a new agent, and a cached Remote would
        send every later READ to the dead one. The next request handshakes again."""
        if remote is None or self._remotes.get(key) is remote:
            self._remotes.pop(key, None)

    def wait(self, request_id: str, timeout_s: float) -> RequestResult:
        """Poll until ``request_id`` ends or ``timeout_s`` passes (then it is failed)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for r in self.poll():
                if r.request_id == request_id:
                    return r
            if request_id not in self._pending:
                raise InvalidRequest(f"request {request_id!r} is not pending")
            if time.monotonic() >= deadline:
                return self.abort(request_id, reason=f"wait() gave up after {timeout_s} s")
            time.sleep(0.0005)

    def abort(self, request_id: str, *, reason: str = "aborted by caller") -> RequestResult:
        p = self._pending.pop(request_id, None)
        if p is None:
            raise InvalidRequest(f"request {request_id!r} is not pending (unknown or ended)")
        result = self._fail(p.result, reason, handle=p.handle, code=ABORTED)
        result.status = "aborted"
        # best effort: let prefill free now instead of at lease expiry
        with contextlib.suppress(Exception):
            self.client(p.remote.host, p.remote.port).call(
                m.Release(request_id=p.remote_request_id, capability=p.capability),
                timeout_s=1.0,
            )
        return result

    def finish(self, request_id: str) -> None:
        """The caller is done with a ready request: return its local blocks to the pool."""
        ids = self._owned.pop(request_id, None)
        if ids is None:
            raise InvalidRequest(f"request {request_id!r} holds no local blocks of this worker")
        self._free_blocks(ids)

    def _finish(self, result: RequestResult, p: _Pending | None) -> RequestResult:
        start = time.perf_counter()
        self.engine.load_to_device(GroupedBlockIds(result.local_block_ids, self.layout))
        result.h2d_s = time.perf_counter() - start
        result.status = "done"
        return result

    def _fail(self, result: RequestResult, reason: str, handle: int | None = None, *,
              code: str = "error") -> RequestResult:
        result.status, result.reason, result.code = "failed", reason, code
        owned = self._owned.pop(result.request_id, None)
        self._release(handle, owned, result.local_block_ids)
        return result

    def _release(self, handle: int | None, owned: list[list[int]] | None,
                 local: list[list[int]]) -> None:
        """Release a handle, then let the local ids go (back to the pool when the worker
        allocated them); if the transport refuses, keep both in flight."""
        if handle is not None:
            try:
                self.transport.release(handle)
            except Exception:
                self._draining[handle] = owned or []
                for g in local:
                    for b in g:
                        if b:
                            self._in_flight[b] = f"draining handle {handle}"
                return
        self._unmark(local)
        if owned:
            self._free_blocks(owned)

    def _unmark(self, local: list[list[int]]) -> None:
        for g in local:
            for b in g:
                self._in_flight.pop(b, None)

    def _free_blocks(self, ids: list[list[int]]) -> None:
        assert self.pool is not None  # only ids the pool allocated are freed here
        for g in ids:
            self.pool.free(g)

    def _retry_draining(self) -> None:
        for handle, blocks in list(self._draining.items()):
            try:
                self.transport.release(handle)
            except InvalidRequest:
                pass  # already gone
            except Exception:
                continue
            del self._draining[handle]
            tag = f"draining handle {handle}"
            for b in [b for b, who in self._in_flight.items() if who == tag]:
                del self._in_flight[b]
            if blocks:
                self._free_blocks(blocks)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    def in_flight(self, block_id: int) -> bool:
        """True while a READ may still write local block ``block_id``."""
        return block_id in self._in_flight

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._pending):
            self.abort(rid, reason="decode worker closed")
        self.transport.close()

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
