"""Decode pipeline: one request's READ as chunks of runs; chunk k is loaded to the device
(h2d) while chunk k+1 is in flight.

Primitives (what `DecodeWorker` calls, from its one thread):
- `split_runs(runs, block_bytes)`: merged runs ``[R, 3]`` (src, dst, n) -> chunks of
  about ``nbytes / TARGET_CHUNKS`` each (at least ``MIN_CHUNK_BYTES``, at most
  ``MAX_CHUNKS``; a run may be cut between two blocks). Below ``2 * MIN_CHUNK_BYTES`` a
  request is one chunk: a chunk's fixed costs (post, poll) would outweigh the overlap.
- `ReadJob`: the chunks of one request, their handles and loads. ``advance`` posts up to
  ``window`` chunks (`window_for` the prefill's host: one on loopback, all across hosts),
  checks finished ones (checksums), hands each DONE chunk to the `Loader` and reports
  "pending", "done" or a failure; ``handles_open`` lists what may still write (the decode
  quarantines the request's ids on them, see decode.py).
- `Loader`: checksum check then h2d of chunks. CUDA: a copy stream, one event per chunk
  (the caller's thread never waits on a copy; the check runs on it). CPU: one worker
  thread for both (torch copies and xxhash release the GIL; with CMA a NIXL READ runs
  inside the posting call, so the check and h2d must run elsewhere to overlap it).

Notification and leases: a one-chunk request carries the completion notification on its
READ, as before. A multi-chunk READ carries none per chunk; when every chunk is DONE the
decode sends the same notification (`Transport.send_notif`): prefill frees its blocks
only after every byte was read, whatever order the chunks finished in.

Failure: any chunk FAILED, timed out, or with a checksum mismatch fails the request; no
further chunk is posted; loads already handed out are waited for (they write the
request's own device blocks, which must not go back to the pool under a running copy);
chunks still PENDING keep the request's ids quarantined until they are over.

Thread rules: every transport call is on the caller's thread; the loader's thread only
copies host rows -> device blocks of chunks whose READ is DONE.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstage.engine import CopyEngine, Direction

if TYPE_CHECKING:
    from kvstage.pd.tp_copy import PartCopy
from kvstage.transport.base import TransferState, Transport

MIN_CHUNK_BYTES = 4 << 20
TARGET_CHUNKS = 4
MAX_CHUNKS = 16
# chunks in flight at once. 1: with CMA (loopback) a READ runs inside its posting call,
# so a second chunk posted at once would delay the first chunk's h2d by a whole chunk.
WINDOW = 1
# across hosts (tcp): every chunk at once. Measured (bench.tcp_link, 128 MiB over a veth,
# READ as % of the same run's TCP stream, contiguous / scattered ids): one chunk in flight
# 66 / 70 %, two 76 / 84 %, four 106 / 101 %: one chunk at a time leaves the link idle
# between chunks and a single transfer does not fill it.
ACROSS_HOSTS_WINDOW = MAX_CHUNKS


def window_for(host: str) -> int:
    """Chunks in flight for a READ from a prefill at ``host``: `WINDOW` on loopback (CMA),
    `ACROSS_HOSTS_WINDOW` otherwise."""
    from kvstage.pd.auth import is_loopback

    return WINDOW if is_loopback(host) else ACROSS_HOSTS_WINDOW


def split_runs(runs: np.ndarray, block_bytes: int, *, min_chunk_bytes: int = MIN_CHUNK_BYTES,
               target_chunks: int = TARGET_CHUNKS, max_chunks: int = MAX_CHUNKS,
               ) -> list[np.ndarray]:
    """Cut ``[R, 3]`` runs into chunks of whole blocks, in order; every block once."""
    total = int(runs[:, 2].sum()) if runs.size else 0
    if total == 0:
        return []
    n = min(max(1, total * block_bytes // min_chunk_bytes), target_chunks, max_chunks, total)
    per = -(-total // n)  # blocks per chunk (the last may be shorter)
    chunks: list[list[tuple[int, int, int]]] = [[]]
    room = per
    for s, d, k in runs.tolist():
        while k:
            take = min(k, room)
            chunks[-1].append((s, d, take))
            s, d, k, room = s + take, d + take, k - take, room - take
            if room == 0 and (k or len(chunks) < n):
                chunks.append([])
                room = per
    return [np.array(c, dtype=np.int64).reshape(-1, 3) for c in chunks if c]


class Loader:
    """h2d of chunk runs: a CUDA copy stream + events, or one CPU worker thread."""

    def __init__(self, engine: CopyEngine | PartCopy) -> None:
        self.engine = engine
        self.cuda = engine.is_cuda
        self._stream = torch.cuda.Stream(engine.cache.device) if self.cuda else None
        self._pool: cf.ThreadPoolExecutor | None = None

    def _copy(self, runs: np.ndarray, local: list[tuple[int, int, int]],
              check: Callable[[np.ndarray], str]) -> tuple[float, str]:
        bad = check(runs)  # the checksums, before a byte of the chunk reaches the device
        if bad:
            return 0.0, bad
        start = time.perf_counter()
        self.engine.copy_runs(local, Direction.H2D)
        return time.perf_counter() - start, ""

    def submit(self, runs: np.ndarray, check: Callable[[np.ndarray], str], *,
               inline: bool = False) -> Any:
        """Start ``check(runs)`` then, if it returns '', loading host rows -> device blocks
        ``runs[:, 1]`` (host row b = block b); ``inline``: now, on this thread (a one-chunk
        request: nothing to overlap). On CUDA ``check`` runs here, the copy on the stream."""
        local = np.stack((runs[:, 1], runs[:, 1], runs[:, 2]), axis=1).tolist()
        if self.cuda:
            bad = check(runs)
            if bad:
                done: cf.Future[tuple[float, str]] = cf.Future()
                done.set_result((0.0, bad))
                return done
            assert self._stream is not None
            # the READ wrote the host rows (CPU) before this call: the stream only reads them
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                start.record(self._stream)
                self.engine._direct(local, Direction.H2D)  # non_blocking copies on the stream
                end.record(self._stream)
            return (start, end)
        if inline:
            done = cf.Future()
            done.set_result(self._copy(runs, local, check))
            return done
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstage-h2d")
        return self._pool.submit(self._copy, runs, local, check)

    @staticmethod
    def done(token: Any) -> bool:
        return bool(token[1].query()) if isinstance(token, tuple) else token.done()

    @staticmethod
    def wait(token: Any) -> tuple[float, str]:
        """Block until the load is over: (its copy time in seconds, '' or the mismatch)."""
        if isinstance(token, tuple):
            token[1].synchronize()
            return float(token[0].elapsed_time(token[1])) / 1e3, ""
        secs, bad = token.result()
        return float(secs), str(bad)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class ReadJob:
    """One request's chunked READ (see the module doc)."""

    chunks: list[np.ndarray]
    peer: str
    notif: bytes
    post: Callable[[np.ndarray, bytes], int]  # runs, notif -> handle (decode's read)
    verify: Callable[[np.ndarray], str]  # runs -> '' or why the bytes are wrong
    handles: list[int | None] = field(default_factory=list)
    states: list[TransferState] = field(default_factory=list)
    loads: list[Any] = field(default_factory=list)
    read_done: float = 0.0  # monotonic time the last chunk's READ was seen DONE
    window: int = 0  # chunks in flight at once (`window_for`); 0: `WINDOW`

    def __post_init__(self) -> None:
        self.handles = [None] * len(self.chunks)
        self.states = [TransferState.PENDING] * len(self.chunks)

    @property
    def single(self) -> bool:
        return len(self.chunks) == 1

    def handles_open(self) -> list[int]:
        """Posted chunks not seen DONE/FAILED: they may still write."""
        return [h for h, s in zip(self.handles, self.states, strict=True)
                if h is not None and s is TransferState.PENDING]

    def handles_all(self) -> list[int]:
        return [h for h in self.handles if h is not None]

    def post_window(self) -> None:
        """Post chunks until ``window`` are in flight (raises what the transport raises)."""
        for i, h in enumerate(self.handles):
            if len(self.handles_open()) >= (self.window or WINDOW):
                return
            if h is None:
                self.handles[i] = self.post(self.chunks[i], self.notif if self.single else b"")

    def advance(self, transport: Transport, loader: Loader) -> tuple[str, str]:
        """Poll posted chunks, load finished ones, post more. Returns ("pending", ""),
        ("done", ""), or (code, why) of the first failure: "failed" (transport FAILED)
        or "checksum"."""
        for i, h in enumerate(self.handles):
            if h is None or self.states[i] is not TransferState.PENDING:
                continue
            state = transport.poll(h)
            if state is TransferState.PENDING:
                continue
            self.states[i] = state
            if state is TransferState.FAILED:
                return "failed", transport.failure_reason(h) or ""
            if all(s is TransferState.DONE for s in self.states):
                self.read_done = time.monotonic()  # before the last load
            self.loads.append(loader.submit(self.chunks[i], self.verify, inline=self.single))
        for t in self.loads:
            if Loader.done(t) and Loader.wait(t)[1]:
                return "checksum", Loader.wait(t)[1]
        if self.read_done:
            if all(Loader.done(t) for t in self.loads):
                return "done", ""
            return "pending", ""
        self.post_window()
        return "pending", ""

    def drain_loads(self) -> float:
        """Wait for every load handed out (bounded: they are memory copies and hashes);
        the sum of their copy times."""
        return sum(Loader.wait(t)[0] for t in self.loads)
