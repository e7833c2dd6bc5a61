"""The prefill worker's d2h, chunk by chunk, off the step's critical path.

Contract
--------
`WorkerSaves(op, stats)` runs the saves the scheduler planned (`prompt_saves`), over the
connector's copy engine (`copies.EngineCopyOp`) and `kvstage.pd.saves.SaveQueue` (the CLI
prefill's background d2h: one CUDA copy stream ordered after the forward that wrote the
blocks, or one CPU thread):

- `save(entries, final, dropped)`, in ``save_kv_to_host`` (after the step's forward):
  ``dropped`` requests' queued saves are waited for and forgotten; every entry's ids are
  queued (`runs_of_ids`: trusted ids, the engine's own runs); then, for each request in
  ``final`` (its prompt completed this step), its saves are waited for: on return its
  bytes are in the host buffer, as vLLM's host path expects before the request's
  ``kv_transfer_params`` leave the engine. A step thus blocks only on its last chunk's
  blocks (and on earlier saves still running, which the FIFO has usually finished).
- `drain()`, before a READ is posted into this instance's host buffer: a save still
  queued for a block vLLM freed (an aborted request) must not land after the READ.
- Figures: one d2h record per request, at its last step (blocks = the distinct ids its
  saves copied, bytes = blocks x block bytes, seconds = the copies' own time, which ran in
  the background except the last chunk's): `stats.KVStageStats`, as before (one copy per
  request), plus the blocks that last step copied (``kvstage_d2h_last_step_blocks``) and
  how long it waited for them (``kvstage_d2h_wait_seconds``: the d2h on TTFT's path).
  A copy's error is counted (``kvstage_copy_failures``) and raised at the
  request's last step, as the synchronous copy raised.
- ``save_by_chunk`` off (`config`): the scheduler plans one save at the last step and
  this runs it queued then waited for at once: the same copy, synchronous.

Threads: every method from vLLM's worker step thread; the copies on SaveQueue's one
thread or stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from kvstage.integrations.vllm.copies import EngineCopyOp
from kvstage.integrations.vllm.stats import KVStageStats
from kvstage.pd.saves import SaveQueue
from kvstage.plan import runs_of_ids


class WorkerSaves:
    """Queued d2h of the connector's save entries (module doc)."""

    def __init__(self, op: EngineCopyOp, stats: KVStageStats) -> None:
        self.op = op
        self.stats = stats
        self.queue = SaveQueue(op.engine)
        self._blocks: dict[str, set[int]] = {}  # ids queued per request, since its start

    def save(self, entries: Mapping[str, Sequence[int]], final: Iterable[str],
             dropped: Iterable[str] = ()) -> None:
        for rid in dropped:
            self._blocks.pop(rid, None)
            if self.queue.pending(rid):
                try:
                    self.queue.wait(rid)
                except Exception:  # noqa: BLE001 - an aborted request's copy: nobody reads it
                    self.stats.record_failed_copy()
        now: dict[str, int] = {}  # blocks each request's entry adds this step
        for rid, ids in entries.items():
            self.queue.submit_runs(rid, runs_of_ids(ids))
            done = self._blocks.setdefault(rid, set())
            before = len(done)
            done.update(b for b in ids if b)
            now[rid] = len(done) - before
        for rid in final:
            blocks = len(self._blocks.pop(rid, ()))
            start = time.perf_counter()
            try:
                seconds = self.queue.wait(rid)
            except BaseException:
                self.stats.record_failed_copy()
                raise
            self.stats.record_copy("d2h", blocks, blocks * self.op.block_bytes, seconds)
            self.stats.record_last_step(now.get(rid, 0), time.perf_counter() - start)

    def drain(self) -> None:
        if self.queue.busy:
            self.queue.drain()

    def close(self) -> None:
        self.queue.close()
