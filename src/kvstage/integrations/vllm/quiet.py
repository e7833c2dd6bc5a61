"""`QuietSteps`: the worker steps that may skip vLLM's NIXL bookkeeping.

vLLM's NIXL worker runs all of its bookkeeping in every engine step, whether or not any
transfer exists: ``start_load_kv`` walks the step's metadata and drains the handshake
queue, ``get_transfer_results`` asks NIXL for notifications and polls the READs in flight,
the failure queue, the send leases and the remote engines to clean up. On an instance
serving requests that move no KV (a P/D instance between transfers, a mixed fleet) that is
most of what the connector cost per step (its hooks: 134-137 us of a 4 ms CPU step, 36-53
us with quiet steps), because each step runs it with caches the forward has just cooled
(NIXL's ``get_new_notifs`` takes 6-14 us right after compute, 0.5 us in a loop:
BENCHMARKS "Quiet steps").

A step is QUIET when its metadata carries nothing for the connector (no request to READ,
to send, in the batch or not processed, no heartbeat, none of kvstage's fields) and the
worker has nothing of its own in flight: no READ it started that vLLM has not reported
finished or failed, no request it may send (``reqs_to_send``) that vLLM has not reported
sent. In a quiet step the worker's ``start_load_kv`` and ``get_transfer_results`` return at
once (nothing to start, nothing can have finished) and ``get_kv_connector_stats`` skips
vLLM's (nothing was recorded).

A full step still runs at least every ``poll_s`` (``kvstage_quiet_poll_ms``, default 100;
0: every step, as vLLM): what vLLM's bookkeeping does for no tracked request (log a
notification for an unknown or expired request, send the notification of a full local hit
whose handshake finished late, release a failed peer) waits at most that long, where an
engine with no step at all waits in vLLM until its next request. The first step after a
pause (`Pauses`: no step for ``poll_s``) is the one that computes a new request's first
token: a full step the poll alone made due waits for the next step, once, so what a plain
request's TTFT carries is the forward, not the bookkeeping (BENCHMARKS "Over ten starts").

Which READs vLLM reports is its own rule, followed here: a request is tracked from
``reqs_to_recv`` when it awaits KV or has local blocks (``awaiting_kvs``,
``local_block_ids``); a notify-only one (a full local hit) is never reported, so is not
tracked (the poll covers its late handshake). Requests only in the batch are not tracked:
no notification can name them before they are in ``reqs_to_send``.

`QuietBuilds` is the scheduler side: vLLM's ``build_connector_meta`` walks the batch and
builds a metadata object every step; it has something to put there only after a hook saw
a request with ``kv_transfer_params`` (``update_state_after_alloc``, ``request_finished``:
``touch``), while a decode request awaits its KV (vLLM heartbeats its prefill: ``wait`` to
``done``) or while kvstage saves a prompt chunk by chunk. Other builds are quiet: the
metadata is an empty one, built at once. A full build still runs every ``poll_s``, so
anything vLLM queued by another path goes out at most that late.

One object per side, used from vLLM's engine thread (scheduler) or worker thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["POLL_MS", "QUIET_KEY", "Pauses", "QuietBuilds", "QuietSteps", "carries_work", "take"]

POLL_MS = 100  # the default of kvstage_quiet_poll_ms
#: the stats key (`stats.KVStageStats`) of ``[side, quiet steps]`` entries, sent with the
#: hook times (``vllm:kvstage_quiet_steps_total{side}``)
QUIET_KEY = "kvstage_quiet_steps"
#: the metadata fields (vLLM's, then kvstage's) that make a step a full one when non-empty
FIELDS = ("reqs_to_recv", "reqs_to_send", "reqs_in_batch", "reqs_not_processed",
          "heartbeat_by_engine", "reqs_to_save", "requests", "saves_final", "saves_dropped")


def take(counter: _Poll) -> int:
    """``counter.quiet`` (its quiet steps since the last take), reset to 0."""
    n, counter.quiet = counter.quiet, 0
    return n


def carries_work(metadata: Any) -> bool:
    """Whether a step's connector metadata has anything for the worker (`FIELDS`; a
    quiet build's, marked ``kvstage_quiet``, has nothing)."""
    if getattr(metadata, "kvstage_quiet", False):
        return False
    return any(getattr(metadata, name, None) for name in FIELDS)


class Pauses:
    """Periodic work off the first step after a pause. ``defer(now, due)`` is called once a
    step (``now``: the clock's reading at its start; ``due``: whether the periodic work is
    due in it) and says whether that work waits for the next step: True when the step
    follows a pause (none started for ``gap``, > 0) and the work was not deferred already
    since it last ran; so it waits one step at most, and an engine stepping back to back
    (or with ``gap`` 0) never defers."""

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self._last: float | None = None
        self._deferred = False

    def defer(self, now: float, due: bool) -> bool:
        last, self._last = self._last, now
        if not due:
            return False
        if (self.gap > 0 and last is not None and now - last >= self.gap
                and not self._deferred):
            self._deferred = True
            return True
        self._deferred = False
        return False


class _Poll:
    """What both sides share: a step is full when it has work or ``poll_s`` (``clock``
    seconds) passed since the last full one; ``quiet`` counts the others (`take`)."""

    def __init__(self, poll_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.poll_s = poll_s
        self.clock = clock
        self.quiet = 0  # quiet steps since the last `take`
        self._last_full = -float("inf")
        self._pauses = Pauses(poll_s)

    def _decide(self, work: bool) -> bool:
        now = self.clock()
        polled = not work and now - self._last_full >= self.poll_s  # due by the poll alone
        wait = self._pauses.defer(now, polled)  # once a step: it times the pauses
        if work or (polled and not wait):
            self._last_full = now
            return True
        self.quiet += 1
        return False


class QuietSteps(_Poll):
    """Which worker steps are quiet (see the module doc)."""

    def __init__(self, poll_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(poll_s, clock)
        self.recving: set[str] = set()  # READs vLLM will report finished or failed
        self.sending: set[str] = set()  # requests vLLM will report sent (or expired)
        self._full = True  # this step runs vLLM's bookkeeping
        self._stats_due = True  # a full step since vLLM last asked for stats

    def begin(self, metadata: Any) -> bool:
        """A step starts with ``metadata``: True when it is a full one (run vLLM's
        ``start_load_kv``, then its ``get_transfer_results``), False when quiet."""
        work = carries_work(metadata)
        if work:
            self._track(metadata)
        self._full = self._decide(work or bool(self.recving or self.sending))
        self._stats_due = self._stats_due or self._full
        return self._full

    def step_is_full(self) -> bool:
        """Whether this step is a full one (run vLLM's ``get_transfer_results``, its save and
        its load-error queue)."""
        return self._full or bool(self.recving or self.sending)

    def reported(self, finished_sending: set[str], finished_recving: set[str],
                 failed_recving: set[str]) -> None:
        """What vLLM's ``get_transfer_results`` reported: no longer in flight."""
        self.sending.difference_update(finished_sending)
        self.recving.difference_update(finished_recving)
        self.recving.difference_update(failed_recving)

    def stats_due(self) -> bool:
        """Whether vLLM's worker stats may hold something (a full step ran since the
        last call); resets."""
        due, self._stats_due = self._stats_due, False
        return due

    def _track(self, metadata: Any) -> None:
        for rid, meta in (getattr(metadata, "reqs_to_recv", None) or {}).items():
            # vLLM's own rule for the READs it reports (pull_worker.start_load_kv)
            if getattr(meta, "awaiting_kvs", True) or any(meta.local_block_ids):
                self.recving.add(rid)
        self.sending.update(getattr(metadata, "reqs_to_send", None) or ())


class QuietBuilds(_Poll):
    """Which scheduler steps build vLLM's metadata (see the module doc)."""

    def __init__(self, poll_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(poll_s, clock)
        self.waiting: set[str] = set()  # decode requests awaiting their KV (heartbeats)
        self._touched = True

    def touch(self) -> None:
        """A hook saw a request with ``kv_transfer_params``: the next build is full."""
        self._touched = True

    def wait(self, req_id: str) -> None:
        self.waiting.add(req_id)
        self._touched = True

    def done(self, req_ids: Iterable[str]) -> None:
        self.waiting.difference_update(req_ids)

    def full(self, busy: bool = False) -> bool:
        """Whether this step's build is vLLM's (``busy``: kvstage itself has work)."""
        full = self._decide(busy or self._touched or bool(self.waiting))
        self._touched = self._touched and not full
        return full
