"""The decode half of a worker rank: each READ started off vLLM's step thread, polled on it.

Contract
--------
`Loads` owns one rank's `kvstage.pd.decode.DecodeWorker`. Starting a request's READ talks to
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

    def __init__(self, role: DecodeWorker, *, rank: int, tp_size: int, key: bytes | None,
                 log: Any, log_reads: bool = False,
                 across_sizes: Callable[[int], str] | None = None) -> None:
        self.role, self.rank, self.tp_size, self.key = role, rank, tp_size, key
        # the refusal of a prefill at another TP size, given that size
        self.across_sizes = across_sizes or (
            lambda tp: f"prefill TP {tp} to decode TP {self.tp_size}: serve prefill and decode "
                       "at the same TP size")
        self.log, self.log_reads = log, log_reads
        self.lock = threading.Lock()  # every call into the role
        self.mutex = threading.Lock()  # the sets and stats below
        self.done: set[str] = set()
        self.failed: set[str] = set()
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
        if remote.tp_size != self.tp_size:
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
        self._queue(lambda: self._start(rid, load, queued), f"the start of request {rid}")

    def forget(self, remote: Remote) -> None:
        """Ask the prefill to release a request this decode will not read."""
        addr = self.address(remote)
        self._queue(lambda: self.role.release_remote(addr, remote.request_id,
                                                     remote.capability),
                    f"the release of {remote.request_id}")

    def heartbeat(self, rid: str, remote: Remote) -> None:
        """Renew the prefill's lease on a request still waiting here (kvstage's Acquire)."""
        addr = self.address(remote)

        def renew() -> None:
            reply = self.role.client(*addr).call(
                m.Acquire(request_id=remote.request_id, capability=remote.capability))
            if not isinstance(reply, m.Lease):
                raise KVStageError(f"unexpected answer to a heartbeat: {type(reply).__name__}")

        self._queue(renew, f"the heartbeat of request {rid}")

    def address(self, remote: Remote) -> tuple[str, int]:
        return remote.host, remote.port + self.rank

    @property
    def busy(self) -> bool:
        """Anything queued, in flight or not yet handed out."""
        return bool(self.queued or self.role.num_pending or self.done)

    def poll(self) -> None:
        """Advance the READs and their h2d, unless the starter is inside the role now."""
        if not self.role.num_pending or not self.lock.acquire(blocking=False):
            return
        try:
            results = self.role.poll()
        finally:
            self.lock.release()
        for r in results:
            if r.status == "done":
                self._record(r)
            else:
                self.fail(r.request_id, f"{r.code}: {r.reason}")

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
            self.role.close()

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

    def _start(self, rid: str, load: Load, queued: float) -> None:
        remote, addr = load.remote, self.address(load.remote)
        waited = time.monotonic() - queued
        with self.mutex:
            known = addr in self.peers
        if not known:
            try:
                socket.create_connection(addr, timeout=PROBE_TIMEOUT_S).close()
            except OSError as e:
                self.fail(rid, f"the prefill's side channel {addr[0]}:{addr[1]} (rank "
                               f"{self.rank}) does not accept connections ({e}): is the "
                               "prefill instance up?")
                return
        began = time.monotonic()
        try:
            with self.lock:
                result = self.role.start(
                    rid, addr, load.remote_block_ids, load.local_block_ids,
                    remote_request_id=remote.request_id, capability=remote.capability)
        except (KVStageError, ValueError, TypeError) as e:
            self._lost(addr)
            self.fail(rid, f"{type(e).__name__}: {e} ({self._timing(waited, began)})")
            return
        if result.status == "failed":
            self._lost(addr)
            self.fail(rid, f"{result.code}: {result.reason} ({self._timing(waited, began)})")
            return
        if result.status == "done":
            self._record(result)
        if not known:
            with self.mutex:
                self.peers.add(addr)
            self.log.info("kvstage: rank %d: handshake with prefill %s rank %d at %s:%d "
                          "passed (kvstage's side channel%s; %.2f s with the first READ's "
                          "start)", self.rank, remote.engine_id, self.rank, *addr,
                          ", sealed with the key" if self.key else "",
                          time.monotonic() - began)

    @staticmethod
    def _timing(waited: float, began: float) -> str:
        return (f"{waited:.2f} s queued behind other starts, then "
                f"{time.monotonic() - began:.2f} s in the start")

    def _lost(self, addr: tuple[str, int]) -> None:
        with self.mutex:
            self.peers.discard(addr)

    def _record(self, r: RequestResult) -> None:
        """A finished READ and h2d into the stats; the request into ``done``."""
        with self.mutex:
            self.done.add(r.request_id)
            if not r.nbytes:
                return  # nothing was read (a request with no blocks to move)
            blocks = sum(len(g) for g in r.local_block_ids)
            self.stats.add(h2d_blocks=blocks, h2d_bytes=r.nbytes, h2d_seconds=r.decode_s,
                           read_bytes=r.nbytes, read_seconds=r.read_s,
                           read_descriptors=r.num_descriptors)
        if self.log_reads:
            self.log.info("%s bytes=%d xfer_us=%d nixl_post_us=%d nixl_descs=%d", LOG_PREFIX,
                          r.nbytes, round(r.read_s * 1e6), 0, r.num_descriptors)
