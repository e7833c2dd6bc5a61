"""The prefill worker's d2h, chunk by chunk: the last step copies at most its own chunk's.

Contract
--------
`WorkerSaves(op, stats)` runs the saves the scheduler planned (`prompt_saves`) over the
connector's copy engine (`copies.EngineCopyOp`):

- CUDA: queued on `kvstage.pd.saves.SaveQueue`'s copy stream (the CLI prefill's
  background d2h), ordered after the forward that wrote the blocks: a chunk's d2h runs
  on the copy engine while the next chunks compute.
- CPU: copied in the step that completed the blocks (direct ``copy_`` of their runs).
  No thread: vLLM binds its CPU worker to the cores it computes on, and a copy thread on
  those cores contends with the forward for them and for the GIL (a thread was measured:
  BENCHMARKS "Saves chunk by chunk"). What moves off the critical path is the step of the
  prompt's last chunk, which copies its own chunk's blocks only.

- `save(entries, final, dropped)`, in ``save_kv_to_host`` (after the step's forward):
  ``dropped`` requests (ended before their last step) are waited for and forgotten; every
  entry's ids are copied or queued (`runs_of_ids`: trusted ids, the engine's own runs);
  then, for each request in ``final`` (its prompt completed this step), its saves are
  waited for: on return its bytes are in the host buffer, as vLLM's host path expects
  before the request's ``kv_transfer_params`` leave the engine.
- `drain()`, before a READ is posted into this instance's host buffer: a save still
  queued for a block vLLM freed (an aborted request) must not land after the READ.
- Figures: one d2h record per request, at its last step (blocks = the distinct ids its
  saves copied, bytes = blocks x block bytes, seconds = the copies' own time):
  `stats.KVStageStats`, as before (one copy per request), plus the blocks that last step
  copied (``kvstage_d2h_last_step_blocks``) and how long its d2h held it up (copying or
  queueing its own entry, then waiting for the request's saves: ``kvstage_d2h_wait_seconds``,
  the d2h on TTFT's path). A copy's error is counted
  (``kvstage_copy_failures``) and raised at the request's last step, as a synchronous
  copy raised.
- ``kvstage_save_by_chunk`` off (`config`): the scheduler plans one save at the last step:
  the same copy, in that step.

Threads: every method from vLLM's worker step thread; CUDA copies on SaveQueue's stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from kvstage.engine import Direction
from kvstage.integrations.vllm.copies import EngineCopyOp
from kvstage.integrations.vllm.stats import KVStageStats
from kvstage.pd.saves import SaveQueue
from kvstage.plan import runs_of_ids


class WorkerSaves:
    """The prefill worker's d2h of the connector's save entries (module doc)."""

    def __init__(self, op: EngineCopyOp, stats: KVStageStats) -> None:
        self.op = op
        self.stats = stats
        # CUDA: queued on a copy stream; CPU: copied in the step (module doc)
        self.queue = SaveQueue(op.engine) if op.engine.is_cuda else None
        self._blocks: dict[str, set[int]] = {}  # ids saved per request, since its start
        self._seconds: dict[str, float] = {}  # CPU: copy seconds per request so far
        self._failed: dict[str, BaseException] = {}  # CPU: a copy's error, for the last step

    def save(self, entries: Mapping[str, Sequence[int]], final: Iterable[str],
             dropped: Iterable[str] = ()) -> None:
        for rid in dropped:
            self._blocks.pop(rid, None)
            self._seconds.pop(rid, None)
            failed = self._failed.pop(rid, None) is not None
            if self.queue is not None and self.queue.pending(rid):
                try:
                    self.queue.wait(rid)
                except Exception:  # noqa: BLE001 - an aborted request's copy: nobody reads it
                    failed = True
            if failed:
                self.stats.record_failed_copy()
        now: dict[str, int] = {}  # blocks each request's entry adds this step
        spent: dict[str, float] = {}  # seconds its entry took to copy or queue
        for rid, ids in entries.items():
            start = time.perf_counter()
            self._copy(rid, ids)
            spent[rid] = time.perf_counter() - start
            done = self._blocks.setdefault(rid, set())
            before = len(done)
            done.update(b for b in ids if b)
            now[rid] = len(done) - before
        for rid in final:
            blocks = len(self._blocks.pop(rid, ()))
            start = time.perf_counter()
            try:
                seconds = self._wait(rid)
            except BaseException:
                self.stats.record_failed_copy()
                raise
            self.stats.record_copy("d2h", blocks, blocks * self.op.block_bytes, seconds)
            self.stats.record_last_step(
                now.get(rid, 0), spent.get(rid, 0.0) + time.perf_counter() - start)

    def _copy(self, rid: str, ids: Sequence[int]) -> None:
        runs = runs_of_ids(ids)
        if self.queue is not None:
            self.queue.submit_runs(rid, runs)
            return
        if rid in self._failed:
            return  # the request fails at its last step: no use copying more of it
        start = time.perf_counter()
        try:
            self.op.engine.copy_runs(runs, Direction.D2H)
        except Exception as e:  # noqa: BLE001 - raised at the request's last step, as queued
            self._failed[rid] = e
        self._seconds[rid] = self._seconds.get(rid, 0.0) + time.perf_counter() - start

    def _wait(self, rid: str) -> float:
        """``rid``'s saves are over: their copy seconds, or the first copy's error."""
        if self.queue is not None:
            return self.queue.wait(rid)
        seconds = self._seconds.pop(rid, 0.0)
        error = self._failed.pop(rid, None)
        if error is not None:
            raise error
        return seconds

    def drain(self) -> None:
        if self.queue is not None and self.queue.busy:
            self.queue.drain()

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
