"""The decode half of a worker rank: each READ started off vLLM's step thread, polled on it.

Contract
--------
`Loads` owns one rank's `kvstage.pd.decode.DecodeWorker` (across TP sizes, one per prefill
rank it reads, each filling one region of the rank's pages: a request is started on every
one, and ends once all of them ended, failed if any failed, so no region is reported while
another may still write its blocks). Starting a request's READ talks to
the prefill's side channel (the handshake the first time, then the Acquire that checks the
capability and extends the lease): on a slow or dead prefill that waits up to the
handshake bound. So ``start`` only queues; one daemon thread (``kvstage-decode-start``)
runs the queued starts in order, and vLLM's step thread polls the READs and runs the h2d
(``poll``), each call into the role under one lock, never waited for by the step thread:
a step that finds the starter inside the role polls on the next step. A step is never
held by a prefill that does not answer.

- A prefill address not yet handshaken is first probed with a TCP connect (bounded): a
  prefill that is not listening (killed, not started) fails the request at once instead
  of after the handshake bound. An address is forgotten after any failure there, so the
  next request probes again.
- ``take()`` hands out, once each, the requests whose READ and h2d are over, and which of
  them failed; failures are logged with the rank and why (vLLM's
  ``kv_load_failure_policy`` then applies).

Threads: vLLM's worker thread calls every method; the starter thread runs the queued
starts. ``done``, ``failed``, ``stats`` and ``peers`` are written by both, under ``mutex``.
"""

from __future__ import annotations

import functools
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvstage.errors import KVStageError
from kvstage.integrations.vllm.config import LOG_PREFIX
from kvstage.integrations.vllm.metadata import Load, Remote
from kvstage.integrations.vllm.stats import KVStageStats
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.reads import RequestResult

PROBE_TIMEOUT_S = 2.0


class Loads:
    """One rank's decode role behind a starter thread (module doc)."""

    def __init__(self, roles: list[tuple[DecodeWorker, int]], *, rank: int, tp_size: int,
                 key: bytes | None, log: Any, log_reads: bool = False,
                 prefill_tp: int | None = None,
                 across_sizes: Callable[[int], str] | None = None) -> None:
        # (role, prefill rank) per region: one at equal TP sizes (prefill rank = ours);
        # across sizes one per prefill rank whose slice fills a region of our pages
        self.roles = roles
        self.role = roles[0][0]  # its side-channel client serves releases and heartbeats
        self.rank, self.tp_size, self.key = rank, tp_size, key
        self.prefill_tp = tp_size if prefill_tp is None else prefill_tp
        # the refusal of a prefill at another TP size, given that size
        self.across_sizes = across_sizes or (
            lambda tp: f"prefill TP {tp} to decode TP {self.tp_size}: serve prefill and decode "
                       "at the same TP size")
        self.log, self.log_reads = log, log_reads
        self.lock = threading.Lock()  # every call into the role
        self.mutex = threading.Lock()  # the sets and stats below
        self.done: set[str] = set()
        self.failed: set[str] = set()
        # a request's regions not ended yet, the first failure, the READs that ended
        self.left: dict[str, int] = {}
        self.why: dict[str, str] = {}
        self.ended: dict[str, list[RequestResult]] = {}
        self.stats = KVStageStats()
        self.peers: set[tuple[str, int]] = set()  # prefill ranks handshaken with
        self.queued = 0  # starts and releases not yet run
        self.work: queue.SimpleQueue[tuple[Callable[[], None], str] | None] = (
            queue.SimpleQueue())
        self.thread = threading.Thread(target=self._run, name="kvstage-decode-start",
                                       daemon=True)
        self.thread.start()

    # -- the step thread ------------------------------------------------------------------------
    def start(self, rid: str, load: Load) -> None:
        remote = load.remote
        if remote.tp_size != self.prefill_tp:
            self.fail(rid, self.across_sizes(remote.tp_size))
            # free it on every prefill rank now, not at its lease's end: this rank releases
            # prefill ranks rank, rank + tp_size, ... (the decode's ranks cover all of them)
            for p in range(self.rank, remote.tp_size, self.tp_size):
                addr = (remote.host, remote.port + p)
                release = functools.partial(self.role.release_remote, addr, remote.request_id,
                                            remote.capability)
                self._queue(release, f"the release of {remote.request_id} on prefill rank {p}")
            return
        queued = time.monotonic()
        with self.mutex:
            self.left[rid] = len(self.roles)
        for role, p in self.roles:
            self._queue(functools.partial(self._start, rid, load, queued, role, p),
                        f"the start of request {rid}")

    def forget(self, remote: Remote) -> None:
        """Ask the prefill to release a request this decode will not read."""
        for _, p in self.roles:
            addr = self.address(remote, p)
            self._queue(functools.partial(self.role.release_remote, addr, remote.request_id,
                                          remote.capability),
                        f"the release of {remote.request_id}")

    def heartbeat(self, rid: str, remote: Remote) -> None:
        """Renew the prefill's lease on a request still waiting here (kvstage's Acquire)."""
        for _, p in self.roles:
            addr = self.address(remote, p)

            def renew(addr: tuple[str, int] = addr) -> None:
                reply = self.role.client(*addr).call(
                    m.Acquire(request_id=remote.request_id, capability=remote.capability))
                if not isinstance(reply, m.Lease):
                    raise KVStageError(
                        f"unexpected answer to a heartbeat: {type(reply).__name__}")

            self._queue(renew, f"the heartbeat of request {rid}")

    @staticmethod
    def address(remote: Remote, prefill_rank: int) -> tuple[str, int]:
        return remote.host, remote.port + prefill_rank

    @property
    def busy(self) -> bool:
        """Anything queued, in flight or not yet handed out."""
        return bool(self.queued or self.done or any(r.num_pending for r, _ in self.roles))

    def poll(self) -> None:
        """Advance the READs and their h2d, unless the starter is inside a role now."""
        if not any(r.num_pending for r, _ in self.roles) or not self.lock.acquire(
                blocking=False):
            return
        try:
            results = [res for role, _ in self.roles if role.num_pending
                       for res in role.poll()]
        finally:
            self.lock.release()
        for r in results:
            self._ended(r.request_id, r, "" if r.status == "done" else f"{r.code}: {r.reason}")

    def take(self) -> tuple[set[str], set[str]]:
        """(finished, failed) since the last call; every failed one is in finished too."""
        with self.mutex:
            done, self.done = self.done, set()
            failed, self.failed = self.failed, set()
        return done, failed

    def take_stats(self) -> KVStageStats:
        with self.mutex:
            out, self.stats = self.stats, KVStageStats()
        return out

    def fail(self, rid: str, why: str) -> None:
        self.log.error("kvstage: request %s: its KV load failed on rank %d: %s", rid,
                       self.rank, why)
        with self.mutex:
            self.done.add(rid)
            self.failed.add(rid)
            self.stats.add(read_failures=1)

    def close(self) -> None:
        self.work.put(None)
        self.thread.join(timeout=5.0)
        with self.lock:
            for role, _ in self.roles:
                role.close()

    # -- the starter thread ---------------------------------------------------------------------
    def _queue(self, job: Callable[[], None], what: str = "") -> None:
        with self.mutex:
            self.queued += 1
        self.work.put((job, what))

    def _run(self) -> None:
        while (item := self.work.get()) is not None:
            job, what = item
            try:
                job()
            except Exception as e:  # a release or heartbeat that failed: the lease decides
                self.log.warning("kvstage: rank %d: %s failed: %s: %s", self.rank,
                                 what or "a job", type(e).__name__, e)
            finally:
                with self.mutex:
                    self.queued -= 1

    def _ended(self, rid: str, result: RequestResult | None, why: str) -> None:
        """One region's READ ended (``why``: '' when it succeeded); the request ends with
        its last region, failed if any failed: no region is reported while another may
        still write its blocks."""
        with self.mutex:
            left = self.left.get(rid, 1) - 1
            if why:
                self.why.setdefault(rid, why)
            elif result is not None:
                self.ended.setdefault(rid, []).append(result)
            if left > 0:
                self.left[rid] = left
                return
            self.left.pop(rid, None)
            failure = self.why.pop(rid, "")
            results = self.ended.pop(rid, [])
        if failure:
            self.fail(rid, failure)
        else:
            self._record(rid, results)

    def _start(self, rid: str, load: Load, queued: float, role: DecodeWorker,
               prefill_rank: int) -> None:
        remote, addr = load.remote, self.address(load.remote, prefill_rank)
        waited = time.monotonic() - queued
        with self.mutex:
            known = addr in self.peers
        if not known:
            try:
                socket.create_connection(addr, timeout=PROBE_TIMEOUT_S).close()
            except OSError as e:
                self._ended(rid, None, f"the prefill's side channel {addr[0]}:{addr[1]} (rank "
                                       f"{prefill_rank}) does not accept connections ({e}): "
                                       "is the prefill instance up?")
                return
        began = time.monotonic()
        try:
            with self.lock:
                result = role.start(
                    rid, addr, load.remote_block_ids, load.local_block_ids,
                    remote_request_id=remote.request_id, capability=remote.capability)
        except (KVStageError, ValueError, TypeError) as e:
            self._lost(addr)
            self._ended(rid, None, f"{type(e).__name__}: {e} ({self._timing(waited, began)})")
            return
        if result.status == "failed":
            self._lost(addr)
            self._ended(rid, None,
                        f"{result.code}: {result.reason} ({self._timing(waited, began)})")
            return
        if result.status == "done":
            self._ended(rid, result, "")
        if not known:
            with self.mutex:
                self.peers.add(addr)
            self.log.info("kvstage: rank %d: handshake with prefill %s rank %d at %s:%d "
                          "passed (kvstage's side channel%s; %.2f s with the first READ's "
                          "start)", self.rank, remote.engine_id, prefill_rank, *addr,
                          ", sealed with the key" if self.key else "",
                          time.monotonic() - began)

    @staticmethod
    def _timing(waited: float, began: float) -> str:
        return (f"{waited:.2f} s queued behind other starts, then "
                f"{time.monotonic() - began:.2f} s in the start")

    def _lost(self, addr: tuple[str, int]) -> None:
        with self.mutex:
            self.peers.discard(addr)

    def _record(self, rid: str, results: list[RequestResult]) -> None:
        """A request's finished READs (one per region) and h2d into the stats; the request
        into ``done``."""
        nbytes = sum(r.nbytes for r in results)
        descs = sum(r.num_descriptors for r in results)
        ops = sum(r.copy_ops for r in results)
        read_s = max((r.read_s for r in results), default=0.0)
        with self.mutex:
            self.done.add(rid)
            if not nbytes:
                return  # nothing was read (a request with no blocks to move)
            blocks = sum(len(g) for g in results[0].local_block_ids)
            self.stats.add(h2d_blocks=blocks, h2d_bytes=nbytes,
                           h2d_seconds=max(r.decode_s for r in results),
                           read_bytes=nbytes, read_seconds=read_s, read_descriptors=descs)
        if self.log_reads:
            self.log.info("%s bytes=%d xfer_us=%d nixl_post_us=%d nixl_descs=%d h2d_ops=%d "
                          "regions=%d", LOG_PREFIX, nbytes, round(read_s * 1e6), 0, descs, ops,
                          len(results))
