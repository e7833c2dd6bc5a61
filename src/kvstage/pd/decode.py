"""DecodeWorker: the decode role. Handshake, READ host -> host over NIXL, then h2d.

Primitives (what an engine calls):
- ``start(request_id, remote_addr, remote_block_ids, local_block_ids, capability=)``:
  handshake once per remote (authenticated with ``key``), confirm the remote lease with
  the request's capability (from prefill's PrefillDone), pair remote and local ids, merge
  the pairs into runs (`pair_runs`) and READ them: one descriptor per run (block-major
  host) or per run per tensor per plane (mirror); with ``pipeline`` (opt-in) in chunks
  of runs, chunk k loaded to the device while k+1 is in flight (`kvstage.pd.pipeline`).
- ``poll()``: advances READs and loads; a request whose every chunk is READ (and, with
  ``verify_checksum``, hashes to prefill's digests: `kvstage.pd.integrity`) and loaded
  is ``done``; a FAILED, timed-out or mismatching one is ``failed`` with a reason/code.
- ``abort(request_id)``: stop waiting for a request and ask the prefill to release it.
- ``finish(request_id)``: the caller is done with a request whose local ids the worker
  allocated from its pool.

Who owns what: the engine owns the device tensors (`KVCache.wrap`) and, when it passes
``local_block_ids``, those ids: the worker refuses ids another in-flight request holds,
and ids its own pool has not allocated. Without ``local_block_ids`` the worker's
``pool`` allocates them. The worker owns the host buffer (one registered allocation)
and the injected `Transport`, which `close` closes.

Late bytes (quarantine): host row b IS local block b (block-major), so a READ that
may still write must keep its blocks. Over UCX tcp a READ of a stalled peer is not
stopped by releasing its handle, nor by ``remove_peer``: when the peer resumes, the
rest of its bytes land (RELIABILITY.md "Can a late READ corrupt another request?").
So a request that failed while a READ of it was PENDING keeps its handles and its local
ids in flight (`LocalIds`: ``num_draining``, ``in_flight(b)``; pool-owned ids are not
freed) until the transport
itself reports each transfer over (DONE or FAILED from ``poll``); only then are the
handles released and the ids let go. A peer that never resumes nor dies keeps them
quarantined: a leak, never a corruption. The engine reuses ids it passed only once
``in_flight`` is False for each of them. (The alternative, a staging row per READ, would
double host memory and add a copy.)

Thread rules: one thread calls every method (NIXL agents are not guaranteed
thread-safe); the pipeline's CPU loader thread only copies host rows to device blocks.
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
    PeerError,
    ProtocolMismatch,
    TransportFailure,
    code_of,
)
from kvstage.pd import auth, integrity
from kvstage.pd import messages as m
from kvstage.pd.handshake import handshake
from kvstage.pd.lease import read_budget
from kvstage.pd.local_ids import LocalIds
from kvstage.pd.pipeline import Loader, ReadJob, split_runs, window_for
from kvstage.pd.reads import (  # noqa: F401  (re-exported: the role's public names)
    ABORTED,
    CHECKSUM_MISMATCH,
    CHECKSUM_MISSING,
    DEFAULT_READ_TIMEOUT_S,
    READ_FAILED,
    READ_TIMEOUT,
    Poster,
    Remote,
    RequestResult,
    _Pending,
    finite_positive,
    pair_runs,
)
from kvstage.pd.side_channel import DEFAULT_TIMEOUT_S, SideChannelClient
from kvstage.pd.tp_copy import HostPart, PartCopy
from kvstage.pd.tp_parts import TPSide
from kvstage.transport.base import Transport


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
        verify_checksum: bool = False,
        pipeline: bool = False,
        prepared_reads: bool = False,
        any_pool_size: bool = False,
        tp: TPSide | None = None,
        region: int = 0,
        slice_index: int = 0,
        num_slices: int = 1,
        host_buffer: HostBuffer | None = None,
    ) -> None:
        """Across TP sizes (``tp``: `kvstage.pd.tp_parts`), this worker fills region
        ``region`` of R of each local page from slice ``slice_index`` of ``num_slices`` of
        one prefill rank's pages (`kvstage.pd.tp_map`); the R workers of a rank share one
        ``host_buffer`` (the device pool's bytes), each registering its region."""
        try:
            self.any_pool_size = bool(any_pool_size)  # `kvstage.pd.handshake`
            self.pipeline = bool(pipeline)  # chunked READ, h2d overlapped (`pd.pipeline`)
            # per-block digests from prefill checked before h2d (`kvstage.pd.integrity`)
            self.verify_checksum = bool(verify_checksum)
            if self.verify_checksum:
                integrity.check_available()
            self.key = key  # the side channel's shared key (`kvstage.pd.auth`), or None
            self.read_timeout_s = finite_positive("read_timeout_s", read_timeout_s)
            self.handshake_timeout_s = finite_positive("handshake_timeout_s",
                                                        handshake_timeout_s)
            self.layout = cache.layout
            self.engine_id = engine_id or f"decode-{uuid.uuid4().hex[:8]}"
            self.cache = cache
            self.pool = pool
            self.tp, self.slice_index, self.num_slices = tp, slice_index, num_slices
            whole = host_buffer or HostBuffer.for_device(self.layout, cache.device, host_layout)
            self.host: HostBuffer | HostPart = whole
            self.engine: CopyEngine | PartCopy = CopyEngine(cache, whole)
            if tp is not None:  # region ``region`` of every page (`kvstage.pd.tp_copy`)
                self.host = HostPart(whole, tp.parts, region)
                self.engine = PartCopy(cache, whole, tp.parts, region=region)
            self.row_bytes = tp.parts.row_bytes if tp else self.layout.block_bytes
            self.loader = Loader(self.engine)
            # prepared descriptor lists (NIXL prep_xfer_dlist once per side), opt-in
            self.poster = Poster(transport, self.host, prepared_reads)
            self.transport = transport
            self.transport.register(self.host.data_ptr, self.host.nbytes)
        except Exception:
            transport.close()
            raise
        self._remotes: dict[tuple[str, int], Remote] = {}
        self._pending: dict[str, _Pending] = {}
        self._owned: dict[str, list[list[int]]] = {}  # request -> local ids we allocated
        self.ids = LocalIds(self.layout, pool, transport)  # in flight, quarantine
        self._closed = False

    # -- handshake ----------------------------------------------------------------------
    def client(self, host: str, port: int) -> SideChannelClient:
        return SideChannelClient(host, port, timeout_s=self.handshake_timeout_s, key=self.key)

    def connect(self, host: str, port: int) -> Remote:
        """Handshake once per remote (`kvstage.pd.handshake`), then reuse it."""
        key = (host, port)
        if key in self._remotes:
            return self._remotes[key]
        remote = handshake(self.client(host, port), host, port, engine_id=self.engine_id,
                           layout=self.layout, host_layout=self.host.host_layout,
                           read_timeout_s=self.read_timeout_s, transport=self.transport,
                           any_pool_size=self.any_pool_size, tp=self.tp,
                           slice_index=self.slice_index, num_slices=self.num_slices)
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
        if not self.any_pool_size:  # else against the prefill's pool, once handshaken
            GroupedBlockIds(remote_block_ids, self.layout)  # validates before anything happens
        local, allocated = self.ids.claim(remote_block_ids, local_block_ids)
        try:
            runs = pair_runs(remote_block_ids, local)
        except (ValueError, TypeError):
            if allocated:
                self.ids.free(local)
            raise
        if allocated:
            self._owned[request_id] = local
        result = RequestResult(request_id, "pending", local_block_ids=local)
        result.num_runs = int(runs.shape[0])
        result.nbytes = int(runs[:, 2].sum()) * self.row_bytes if runs.size else 0
        try:
            remote = self.connect(*remote_addr)
            if self.any_pool_size:  # a prefill's pool may be larger or smaller than ours
                GroupedBlockIds(remote_block_ids, remote.layout)
            if runs.shape[0] == 0:
                return self._finish(result, None)
            lease = self.client(*remote_addr).call(
                m.Acquire(request_id=remote_rid, capability=capability,
                          slice_index=self.slice_index)
            )
            if not isinstance(lease, m.Lease):
                raise ProtocolMismatch(
                    f"unexpected answer to Acquire: {type(lease).__name__}"
                )
            if lease.engine_id and lease.engine_id != remote.engine_id:
                # the prefill restarted on this address: its agent and buffer are new
                self._forget((remote_addr[0], remote_addr[1]))
                remote = self.connect(*remote_addr)
            if self.verify_checksum and not lease.checksums:
                self.release_remote(remote_addr, remote_rid, capability)
                return self._fail(result, "prefill sent no checksums: start it with "
                                  "verify_checksum (--verify-checksum) too",
                                  code=CHECKSUM_MISSING)
            digests = (integrity.digest_map(remote_block_ids, lease.checksums)
                       if self.verify_checksum else None)
            if isinstance(self.engine, PartCopy):  # the group of each local id: its segments
                self.engine.assign(local)
            chunks = (split_runs(runs, self.row_bytes) if self.pipeline else [runs])
            job = ReadJob(chunks, remote.peer, auth.completion_notif(remote_rid, capability),
                          post=lambda r, notif: self.poster.post(remote, r, notif),
                          verify=lambda r: self._verify(r, digests),
                          window=window_for(remote.host))
            result.num_descriptors = sum(
                int(self.host.descriptors(c[:, 1], c[:, 2]).shape[0]) for c in chunks)
            result.num_chunks = len(chunks)
            result.copy_ops = sum(self.engine.ops_for_runs(c) for c in chunks)
            started = time.monotonic()
            job.post_window()
        except Exception as exc:  # every failure ends as a failed request, never a crash
            if isinstance(exc, TransportFailure):
                self._forget((remote_addr[0], remote_addr[1]))
            code = exc.remote_code if isinstance(exc, PeerError) else code_of(exc)
            job_or_none = locals().get("job")
            return self._fail(result, f"{type(exc).__name__}: {exc}", code=code,
                              job=job_or_none if isinstance(job_or_none, ReadJob) else None)
        budget = read_budget(self.read_timeout_s, lease.remaining_s)  # pd.lease
        self._pending[request_id] = _Pending(
            result, remote, remote_rid, job, started, started + budget, capability,
        )
        self.ids.mark(local, request_id)
        return result

    def poll(self) -> list[RequestResult]:
        """Advance every pending READ without blocking (with CMA a chunk's READ runs inside
        its post); returns requests that ended."""
        self.ids.retry()
        ended = []
        for rid, p in list(self._pending.items()):
            code = READ_FAILED
            try:
                state, why = p.job.advance(self.transport, self.loader)
            except Exception as exc:  # a chunk's post refused (TransportFailure), a poll
                state, why = "failed", f"{type(exc).__name__}: {exc}"
                code = code_of(exc) if isinstance(exc, KVStageError) else READ_FAILED
            now = time.monotonic()
            if state == "pending" and (now < p.deadline or p.job.read_done):
                continue  # (after the last READ only loads are left: no deadline)
            del self._pending[rid]
            p.result.read_s = (p.job.read_done or now) - p.started
            if state == "done":
                ended.append(self._done(p, now))
                continue
            code = {"checksum": CHECKSUM_MISMATCH, "pending": READ_TIMEOUT}.get(state, code)
            if state == "pending":
                why = f"READ timed out after {now - p.started:.2f} s"
            elif state == "failed":
                why = why or ("the transport reported the READ failed (peer gone or remote "
                              "memory invalid)")
            if state != "checksum":
                self._forget((p.remote.host, p.remote.port), p.remote)
            ended.append(self._fail(p.result, why, code=code, job=p.job))
            if state == "checksum" and not p.job.single:  # no chunk carried the notification
                self.release_remote((p.remote.host, p.remote.port), p.remote_request_id,
                                     p.capability)
        return ended

    def _done(self, p: _Pending, now: float) -> RequestResult:
        """Every chunk READ and loaded: release, notify prefill (multi-chunk), report."""
        p.result.h2d_s = p.job.drain_loads()
        self.ids.release(p.job.handles_all(), None, p.result.local_block_ids)
        if not p.job.single:  # the notification no chunk carried (module doc of pd.pipeline)
            with contextlib.suppress(Exception):  # else prefill's lease frees it
                self.transport.send_notif(p.job.peer, p.job.notif)
        p.result.decode_s = now - p.started
        p.result.status = "done"
        return p.result

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
        result = self._fail(p.result, reason, code=ABORTED, job=p.job)
        result.status = "aborted"
        self.release_remote((p.remote.host, p.remote.port), p.remote_request_id,
                             p.capability)
        return result

    def release_remote(self, addr: tuple[str, int], rid: str, capability: bytes) -> None:
        """Best effort: let prefill free now instead of at lease expiry."""
        with contextlib.suppress(Exception):
            self.client(*addr).call(m.Release(request_id=rid, capability=capability),
                                    timeout_s=1.0)

    def _verify(self, runs: np.ndarray, digests: dict[int, int] | None) -> str:
        """'' when checksums are off or every block of ``runs`` hashes to prefill's digest."""
        if not self.verify_checksum:
            return ""
        bad = integrity.run_mismatches(self.host, runs, digests)
        return integrity.describe(bad, int(runs[:, 2].sum())) if bad else ""

    def finish(self, request_id: str) -> None:
        """The caller is done with a ready request: return its local blocks to the pool."""
        ids = self._owned.pop(request_id, None)
        if ids is None:
            raise InvalidRequest(f"request {request_id!r} holds no local blocks of this worker")
        self.ids.free(ids)

    def _finish(self, result: RequestResult, p: _Pending | None) -> RequestResult:
        start = time.perf_counter()
        self.engine.load_to_device(GroupedBlockIds(result.local_block_ids, self.layout))
        result.h2d_s = time.perf_counter() - start
        result.status = "done"
        return result

    def _fail(self, result: RequestResult, reason: str, *, code: str = "error",
              job: ReadJob | None = None) -> RequestResult:
        """Fail a request: its loads are waited for, then its ids are let go, or kept
        quarantined while a chunk's READ may still write (module doc)."""
        result.status, result.reason, result.code = "failed", reason, code
        owned = self._owned.pop(result.request_id, None)
        if job is not None:
            job.drain_loads()
        self.ids.end(job.handles_all() if job else [], job.handles_open() if job else [],
                     owned, result.local_block_ids)
        return result

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_draining(self) -> int:
        """Quarantined READs (their ids wait for the transfer to be over)."""
        return len(self.ids.draining)

    def in_flight(self, block_id: int) -> bool:
        """True while a READ may still write local block ``block_id``."""
        return block_id in self.ids.in_flight

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._pending):
            self.abort(rid, reason="decode worker closed")
        self.transport.close()  # no READ of a closed transport writes: let all go
        self.loader.close()
        self.ids.drop_all()

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
