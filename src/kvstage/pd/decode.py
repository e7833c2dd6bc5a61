"""DecodeWorker: handshake, NIXL READ host -> host with merged descriptors, then h2d.

`start` handshakes once per remote, confirms the remote lease, pairs remote and local
ids group by group, merges the pairs into runs (`find_runs`) and posts ONE READ whose
descriptors are one per run (block-major host) or one per run per tensor per plane
(mirror). `poll` never blocks: a DONE READ is loaded to the device and reported ready;
a FAILED or timed-out one is reported failed with a reason, its h2d skipped and its
local blocks freed. A handle NIXL will not release yet keeps its blocks out of the
pool until it can be released, so bytes can never land in reused blocks.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstage.blocks import BlockPool, GroupedBlockIds
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.engine import CopyEngine
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd.handshake import DEFAULT_TIMEOUT_S, SideChannelClient
from kvstage.plan import find_runs
from kvstage.transport.base import TransferState, TransportError
from kvstage.transport.factory import make_transport

DEFAULT_READ_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Remote:
    """A handshaken prefill engine."""

    host: str
    port: int
    engine_id: str
    peer: str
    layout: KVLayout
    host_layout: HostLayout
    base: int
    lease_s: float


@dataclass
class RequestResult:
    request_id: str
    status: str  # "pending" | "done" | "failed" | "aborted"
    reason: str = ""
    local_block_ids: list[list[int]] = field(default_factory=list)
    nbytes: int = 0
    num_descriptors: int = 0
    num_runs: int = 0
    read_s: float = 0.0
    h2d_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "done"


@dataclass
class _Pending:
    result: RequestResult
    remote: Remote
    remote_request_id: str
    handle: int
    started: float
    deadline: float


def pair_runs(
    remote_ids: Sequence[Sequence[int]], local_ids: Sequence[Sequence[int]]
) -> np.ndarray:
    """Pair remote and local ids group by group and merge into runs ``[R, 3]``.

    A local list shorter than the remote one is a prefix decode already holds: the
    remote list is end-aligned to it (vLLM's prefix trim). Null pairs are skipped.
    """
    if len(remote_ids) != len(local_ids):
        raise ValueError(
            f"remote has {len(remote_ids)} id lists, local {len(local_ids)}: one per group"
        )
    src, dst = [], []
    for g, (r, loc) in enumerate(zip(remote_ids, local_ids, strict=True)):
        if len(loc) > len(r):
            raise ValueError(
                f"group {g}: {len(loc)} local blocks for {len(r)} remote ones; decode can "
                "receive at most what prefill holds"
            )
        r = list(r)[len(r) - len(loc) :]
        for a, b in zip(r, loc, strict=True):
            if (a == 0) != (b == 0):
                raise ValueError(f"group {g}: null block paired with a real one ({a} -> {b})")
            if a:
                src.append(a)
                dst.append(b)
    return find_runs(np.array(src, np.int64), np.array(dst, np.int64))


class DecodeWorker:
    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str = "cpu",
        host_layout: HostLayout = HostLayout.BLOCK_MAJOR,
        transport: str = "nixl",
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        handshake_timeout_s: float = DEFAULT_TIMEOUT_S,
        engine_id: str | None = None,
    ) -> None:
        if read_timeout_s <= 0 or handshake_timeout_s <= 0:
            raise ValueError("read_timeout_s and handshake_timeout_s must be > 0")
        self.layout = layout
        self.read_timeout_s = read_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.engine_id = engine_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.cache = KVCache(layout, device)
        self.host = HostBuffer.for_device(layout, device, host_layout)
        self.engine = CopyEngine(self.cache, self.host)
        self.pool = BlockPool(layout.num_blocks)
        self.transport = make_transport(transport, self.engine_id)
        self.transport.register(self.host.data_ptr, self.host.nbytes)
        self._remotes: dict[tuple[str, int], Remote] = {}
        self._pending: dict[str, _Pending] = {}
        self._owned: dict[str, list[list[int]]] = {}  # request -> local ids we allocated
        self._draining: dict[int, list[list[int]]] = {}  # handle -> blocks held back
        self._closed = False

    # -- handshake ----------------------------------------------------------------------
    def client(self, host: str, port: int) -> SideChannelClient:
        return SideChannelClient(host, port, timeout_s=self.handshake_timeout_s)

    def connect(self, host: str, port: int) -> Remote:
        """Handshake once per remote: fetch its agent metadata and layout, check both."""
        key = (host, port)
        if key in self._remotes:
            return self._remotes[key]
        meta = self.client(host, port).call(m.GetMeta(engine_id=self.engine_id))
        if not isinstance(meta, m.Meta):
            raise ValueError(f"{host}:{port} answered GetMeta with {type(meta).__name__}")
        remote_layout = m.layout_from_msg(meta.layout)
        self.layout.check_compatible(remote_layout)
        if meta.host_layout != self.host.host_layout.value:
            raise ValueError(
                f"incompatible host buffer: host_layout is {self.host.host_layout.value!r} "
                f"here, {meta.host_layout!r} remote; start both sides with the same one"
            )
        if self.read_timeout_s >= meta.lease_s:
            raise ValueError(
                f"read_timeout_s ({self.read_timeout_s}) must be below the prefill lease "
                f"({meta.lease_s} s), else a READ could outlive the blocks it reads"
            )
        peer = self.transport.add_peer(meta.agent_metadata)
        remote = Remote(
            host, port, meta.engine_id, peer, remote_layout, self.host.host_layout,
            meta.host_base, meta.lease_s,
        )
        self._remotes[key] = remote
        return remote

    # -- requests ---------------------------------------------------------------------------
    def start(
        self,
        request_id: str,
        remote_addr: tuple[str, int],
        remote_block_ids: Sequence[Sequence[int]],
        local_block_ids: Sequence[Sequence[int]] | None = None,
        *,
        remote_request_id: str | None = None,
    ) -> RequestResult:
        """Post the READ for one request; returns its (pending or failed) result."""
        if request_id in self._pending or request_id in self._owned:
            raise ValueError(
                f"request id {request_id!r} is already in flight here; finish or abort it "
                "first, or use a new id"
            )
        remote_rid = remote_request_id or request_id
        GroupedBlockIds(remote_block_ids, self.layout)  # validates before anything happens
        allocated = local_block_ids is None
        if local_block_ids is None:
            counts = [len(g) for g in remote_block_ids]
            if sum(counts) > self.pool.num_free:
                raise ValueError(
                    f"request needs {sum(counts)} local blocks, {self.pool.num_free} are free"
                )
            local_block_ids = [self.pool.allocate(n) for n in counts]
        local = [list(g) for g in local_block_ids]
        try:
            GroupedBlockIds(local, self.layout)
            runs = pair_runs(remote_block_ids, local)
        except (ValueError, TypeError):
            if allocated:
                for ids in local:
                    self.pool.free(ids)
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
            lease = self.client(*remote_addr).call(m.Acquire(request_id=remote_rid))
            if not isinstance(lease, m.Lease):
                raise ValueError(f"unexpected answer to Acquire: {type(lease).__name__}")
            local_d = self.host.descriptors(runs[:, 1], runs[:, 2])
            remote_d = self._remote_descs(remote, runs)
            result.num_descriptors = int(local_d.shape[0])
            started = time.monotonic()
            handle = self.transport.read(remote.peer, local_d, remote_d, remote_rid.encode())
        except Exception as exc:  # every failure ends as a failed request, never a crash
            if isinstance(exc, TransportError):
                self._forget((remote_addr[0], remote_addr[1]))
            return self._fail(result, f"{type(exc).__name__}: {exc}")
        budget = min(self.read_timeout_s, lease.remaining_s)
        self._pending[request_id] = _Pending(
            result, remote, remote_rid, handle, started, started + budget
        )
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
                state, why = TransferState.FAILED, f"poll failed: {exc}"
            else:
                why = "NIXL reported the READ failed (peer gone or remote memory invalid)"
            if state is TransferState.PENDING and now < p.deadline:
                continue
            del self._pending[rid]
            p.result.read_s = now - p.started
            if state is TransferState.DONE:
                self._release(p.handle, None)
                ended.append(self._finish(p.result, p))
            else:
                if state is TransferState.PENDING:
                    why = f"READ timed out after {now - p.started:.2f} s"
                self._forget((p.remote.host, p.remote.port), p.remote)
                ended.append(self._fail(p.result, why, handle=p.handle))
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
                raise ValueError(f"request {request_id!r} is not pending")
            if time.monotonic() >= deadline:
                return self.abort(request_id, reason=f"wait() gave up after {timeout_s} s")
            time.sleep(0.0005)

    def abort(self, request_id: str, *, reason: str = "aborted by caller") -> RequestResult:
        p = self._pending.pop(request_id, None)
        if p is None:
            raise ValueError(f"request {request_id!r} is not pending (unknown or ended)")
        result = self._fail(p.result, reason, handle=p.handle)
        result.status = "aborted"
        # best effort: let prefill free now instead of at lease expiry
        with contextlib.suppress(Exception):
            self.client(p.remote.host, p.remote.port).call(
                m.Release(request_id=p.remote_request_id), timeout_s=1.0
            )
        return result

    def finish(self, request_id: str) -> None:
        """The caller is done with a ready request: return its local blocks to the pool."""
        ids = self._owned.pop(request_id, None)
        if ids is None:
            raise ValueError(f"request {request_id!r} holds no local blocks of this worker")
        for g in ids:
            self.pool.free(g)

    def _finish(self, result: RequestResult, p: _Pending | None) -> RequestResult:
        start = time.perf_counter()
        self.engine.load_to_device(GroupedBlockIds(result.local_block_ids, self.layout))
        result.h2d_s = time.perf_counter() - start
        result.status = "done"
        return result

    def _fail(self, result: RequestResult, reason: str, handle: int | None = None) -> RequestResult:
        result.status, result.reason = "failed", reason
        blocks = self._owned.pop(result.request_id, None)
        self._release(handle, blocks)
        return result

    def _release(self, handle: int | None, blocks: list[list[int]] | None) -> None:
        """Release a handle, then free the blocks; if NIXL refuses, hold both back."""
        if handle is not None:
            try:
                self.transport.release(handle)
            except Exception:
                self._draining[handle] = blocks or []
                return
        for g in blocks or []:
            self.pool.free(g)

    def _retry_draining(self) -> None:
        for handle, blocks in list(self._draining.items()):
            try:
                self.transport.release(handle)
            except (TransportError, RuntimeError):
                continue
            except ValueError:
                pass  # already gone
            del self._draining[handle]
            for g in blocks:
                self.pool.free(g)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_draining(self) -> int:
        return len(self._draining)

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
