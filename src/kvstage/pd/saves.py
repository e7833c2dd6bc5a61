"""Background d2h for chunked prefill: the save of chunk k overlaps the compute of k+1.

`PrefillWorker.save(request_id, ids, wait=False)` validates and plans on the caller's
thread, then hands the copy to a `SaveQueue` and returns: the engine goes on computing
the next chunk while the KV it already wrote moves to the host buffer.

- CUDA: one copy stream. Each save first makes the stream wait for the caller's current
  stream (the forward pass that wrote those blocks), queues its copies, and records an
  event. The caller's thread never blocks on a copy.
- CPU: one worker thread, FIFO (torch's ``copy_`` releases the GIL, so it runs beside
  the caller's compute; a matmul releases it too).

Order: saves run in submission order, so a block saved twice (the boundary block a chunk
left partly filled, completed by the next) ends with the later bytes; a synchronous save
of another request's blocks may run beside them (engines never give two live requests
one block). ``wait(request_id)`` blocks until that request's saves are over and returns
their copy seconds, raising the first error a copy raised; the worker calls it in
``hold`` (decode may READ only finished bytes) and before giving blocks back (a late copy
must not read a block the engine reuses).

`submit_runs` queues trusted ``(src, dst, n)`` runs instead of a plan (the vLLM
connector's saves: `kvstage.pd.prompt_saves` plans them); `drain` waits for every queued
save without taking any request's figures (before a READ writes host blocks a late save
could still be copying into).

Thread rules: ``submit``, ``submit_runs``, ``wait`` and ``drain`` from one thread (the
worker's owner).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstage.engine import CopyEngine, Direction

if TYPE_CHECKING:
    from kvstage.pd.tp_copy import PartCopy

__all__ = ["SaveQueue"]


class SaveQueue:
    """Asynchronous d2h of planned saves over one `CopyEngine` (see the module doc)."""

    def __init__(self, engine: CopyEngine | PartCopy) -> None:
        self.engine = engine
        self.cuda = engine.is_cuda
        self._stream = torch.cuda.Stream(engine.cache.device) if self.cuda else None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pending: dict[str, list[Any]] = {}

    def _timed(self, copy: Callable[[bool], object]) -> float:
        """Run one queued copy (in the CPU thread); its seconds."""
        start = time.perf_counter()
        copy(True)
        return time.perf_counter() - start

    def submit(self, request_id: str, plan: Any) -> None:
        """Queue the d2h of ``plan`` (validated ids: the engine's own plan, a `CopyPlan`
        or a `kvstage.pd.tp_copy.PartPlan`) for ``request_id``."""
        if plan.num_blocks:
            self._launch(request_id,
                         lambda sync: self.engine.run(plan, Direction.D2H, sync=sync))

    def submit_runs(self, request_id: str, runs: np.ndarray | list[tuple[int, int, int]]
                    ) -> None:
        """Queue the d2h of trusted block ``runs`` (``(src, dst, n)``) for ``request_id``."""
        if len(runs):
            self._launch(request_id,
                         lambda sync: self.engine.copy_runs(runs, Direction.D2H, sync=sync))

    def _launch(self, request_id: str, copy: Callable[[bool], object]) -> None:
        token: Any
        if self._stream is not None:
            device = self.engine.cache.device
            self._stream.wait_stream(torch.cuda.current_stream(device))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                start.record(self._stream)
                copy(False)
                end.record(self._stream)
            token = (start, end)
        else:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvstage-d2h")
            token = self._pool.submit(self._timed, copy)
        self._pending.setdefault(request_id, []).append(token)

    def drain(self) -> None:
        """Block until every queued save has run (each request's figures stay for
        `wait`); errors stay with their requests too."""
        if self._stream is not None:
            self._stream.synchronize()
            return
        for tokens in self._pending.values():
            cf.wait(tokens)

    def pending(self, request_id: str) -> int:
        return len(self._pending.get(request_id, ()))

    @property
    def busy(self) -> bool:
        """Some request has saves not yet waited for."""
        return bool(self._pending)

    def wait(self, request_id: str) -> float:
        """Block until ``request_id``'s saves are over; their copy seconds. Raises the
        first copy's error (every save of the request is waited for first)."""
        tokens = self._pending.pop(request_id, [])
        secs, error = 0.0, None
        for token in tokens:
            try:
                if isinstance(token, tuple):
                    token[1].synchronize()
                    secs += float(token[0].elapsed_time(token[1])) / 1e3
                else:
                    secs += float(token.result())
            except Exception as e:  # noqa: BLE001 - re-raised below, after the rest
                error = error or e
        if error is not None:
            raise error
        return secs

    def close(self) -> None:
        """Wait for every queued save (errors dropped: the requests are being freed)."""
        for rid in list(self._pending):
            with contextlib.suppress(Exception):  # closing: nothing left to report to
                self.wait(rid)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
