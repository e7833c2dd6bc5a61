"""Lease check inside `KVStageConnector`: a decode never READs blocks whose prefill lease
may have ended.

The decision is `kvstage.pd.lease`'s (the CLI's decode bounds its READ by the same time
left); this module carries its inputs through vLLM.

Why: vLLM 0.32.0's prefill frees a request's held blocks when ``kv_lease_duration`` ends
(``kv_connector_extra_config``, default 30 s); the decode heartbeats the prefill (extending
the hold) only for requests already in its scheduler. A decode that reaches a request later
(stalled, backlogged) READs blocks that other requests have refilled and decodes their KV
(RELIABILITY.md "Serving faults"). vLLM checks an expiry only for its bidirectional turn-2
read; this module does the same for the prefill's blocks.

Contract
--------
- Prefill scheduler (`stamp`): the ``kv_transfer_params`` ``request_finished`` hands out
  for a decode carry ``"kvstage_lease_expires"``: the end of the lease in the prefill
  scheduler process's ``time.perf_counter`` seconds, taken BEFORE vLLM stamps its own
  deadline (so it is never later than vLLM's; the prefill worker's deadline, rebased by
  vLLM, and heartbeats only make the hold longer).
- Decode scheduler: hands each request's values to its worker in the connector metadata
  (`request_params`, read here as ``kvstage_leases`` and ``kvstage_lease_extensions``).
- Decode worker (`WorkerLeases.refusal`, called in ``_read_blocks_for_req`` once the
  prefill is handshaken, so also for requests queued behind a handshake): the deadline on
  the local clock is ``value - clock offset``, the offset being vLLM's handshake estimate
  of the prefill's ``perf_counter`` (``_engine_clock_offset``, the best of its round trips;
  kvstage's listener echoes ``perf_counter`` from the same process as vLLM's). No wall
  clocks are compared: hosts need not be time-synchronised, only their ``perf_counter``
  rates equal. When ``now + margin >= deadline`` the READ is not started and the request
  fails its KV load (``failed_recving``, as vLLM declines an expired turn-2 read; counted
  in ``kv_expired_reqs``): vLLM's ``kv_load_failure_policy`` applies (``fail``: an error;
  ``recompute``: computed locally). A value that is not a finite number is refused the same
  way, logged. No value (an older kvstage prefill): read as before.
- Heartbeats (`WorkerLeases.heartbeats_sent`, after vLLM's ``start_load_kv`` sent the
  step's): vLLM's decode heartbeats every prefill it waits on (once a heartbeat interval,
  from the moment a request enters its scheduler), and the prefill moves the deadline to
  the heartbeat's arrival + ``kv_lease_duration * 2 // 3``; the prefill stamps that
  extension (``lease_extension_s`` of `request_params`) beside the deadline. A heartbeat
  counts when it left with more than the margin to go (`extended`), the margin's own
  assumption for a READ's start; without the extension (an older prefill), none counts.
  Without this a slow link or a short lease refused READs whose blocks vLLM still held
  (tests/system/vllm/test_serving_netns.py, the slow-link variant: 5 of 16 at a 6 s lease).
- Margin: ``"kvstage_lease_margin_s"`` in ``kv_connector_extra_config`` (seconds, a finite
  number >= 0), by default this instance's heartbeat interval (``kv_lease_duration // 6``,
  the longest a request waits for its first heartbeat) + 2 s (the offset's error, the READ's
  start), parsed with the connector's other settings (`config.KVStageConfig`). Requests
  without local blocks to fill (full local hits, aborts) are not checked: they read nothing.

Threads: the scheduler parts run in vLLM's scheduler step, the worker parts in its worker
step; nothing here starts a thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Container, Mapping, Sequence
from typing import Any

from vllm.logger import init_logger

from kvstage.pd import lease as pd_lease

logger = init_logger(f"vllm.{__name__}")

EXPIRES_KEY = "kvstage_lease_expires"
EXTENSION_KEY = "kvstage_lease_extension_s"
MARGIN_KEY = "kvstage_lease_margin_s"
MAX_HEARTBEATS = 64  # send times kept per request (one per heartbeat interval, >= 1 s)
MAX_TRACKED = 4096  # requests whose heartbeats are kept (more than a decode's queue)


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None (bools and strings are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def stamp(params: dict[str, Any] | None, delay_free: bool, started: float,
          lease_s: float) -> None:
    """Prefill: add the lease's end to the params handed to a decode (in place)."""
    if params is not None and delay_free and params.get("do_remote_prefill"):
        params[EXPIRES_KEY] = started + lease_s
        params[EXTENSION_KEY] = heartbeat_extension_s(lease_s)


def heartbeat_extension_s(lease_s: float) -> float:
    """How far a heartbeat moves a request's deadline on vLLM's prefill: to its arrival +
    ``kv_lease_duration * 2 // 3`` (``NixlConnectorWorker._handle_heartbeat``, vLLM 0.32.0
    and 0.33.0; test_vllm_lease pins the formula in vLLM's source)."""
    return float(lease_s * 2 // 3)


def extended(expires: float, clock_offset: float, sent: Sequence[float],
             extension_s: float, margin: float) -> float:
    """The prefill's deadline (its clock) once the decode's heartbeats sent at ``sent``
    (local clock) count. One sent with more than ``margin`` of the lease left reached the
    prefill while it still held the blocks (what the margin assumes of a READ's start) and
    moved the deadline to at least its send time + ``extension_s`` (vLLM extends from the
    arrival, later than the send; ``t + offset`` maps the send onto the prefill's clock and
    `time_left` maps it back, so the offset's error cancels)."""
    for t in sorted(sent):
        if pd_lease.time_left(expires, clock_offset, t) > margin:
            expires = max(expires, t + clock_offset + extension_s)
    return expires


def refusal(value: Any, clock_offset: float, now: float, margin: float,
            sent: Sequence[float] = (), extension_s: float = 0.0) -> str | None:
    """Why a READ must not start (a sentence), or None to read: `kvstage.pd.lease`'s
    decision on the stamped deadline, as vLLM's handshake offset maps it, extended by the
    heartbeats sent for the request (`extended`)."""
    expires = _number(value)
    if expires is None:
        return (f"its kv_transfer_params carry {EXPIRES_KEY}={value!r}, not a number of "
                "seconds; the prefill's blocks may be anyone's")
    expires = extended(expires, clock_offset, sent, extension_s, margin)
    return pd_lease.read_refusal(pd_lease.time_left(expires, clock_offset, now), margin,
                                 margin_name=MARGIN_KEY)


class WorkerLeases:
    """Decode worker side: the values the scheduler handed over, checked before a READ."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self._expires: dict[str, Any] = {}  # request id -> params value
        self._extension: dict[str, float] = {}  # request id -> its prefill's extension
        self._sent: dict[str, list[float]] = {}  # prefill's request id -> heartbeats sent

    def expect(self, metadata: Any) -> None:
        self._expires.update(getattr(metadata, "kvstage_leases", {}))
        self._extension.update(getattr(metadata, "kvstage_lease_extensions", {}))

    def heartbeats_sent(self, metadata: Any, handshaken: Container[str],
                        now: float | None = None) -> None:
        """Record the heartbeats vLLM's worker sent this step (``heartbeat_by_engine`` of
        the step's metadata: prefill engine -> its request ids; vLLM sends them at the end
        of ``start_load_kv``, to prefills already handshaken only)."""
        by_engine = getattr(metadata, "heartbeat_by_engine", None) or {}
        t = time.perf_counter() if now is None else now
        for engine_id, info in by_engine.items():
            if engine_id not in handshaken:
                continue
            for rid in list(getattr(info, "req_ids", ()))[:MAX_TRACKED]:
                sent = self._sent.setdefault(rid, [])
                if len(sent) < MAX_HEARTBEATS:
                    sent.append(t)
        if len(self._sent) > MAX_TRACKED:  # requests that never reached a READ here
            for rid in list(self._sent)[:len(self._sent) - MAX_TRACKED]:
                del self._sent[rid]

    def refusal(self, req_id: str, meta: Any, clock_offsets: Mapping[str, float],
                now: float | None = None) -> str | None:
        """Why ``req_id``'s READ (``meta``: vLLM's ReqMeta, its prefill handshaken, its
        offset in ``clock_offsets``) must not start, or None."""
        if req_id not in self._expires or meta.remote is None:
            return None
        if not any(meta.local_physical_block_ids or ()):
            return None  # nothing to READ (full local hit, abort): only a notification
        offset = clock_offsets.get(meta.remote.engine_id)
        if offset is None:
            return None  # not handshaken (vLLM's path handshakes, then calls again)
        value = self._expires.pop(req_id)
        sent = self._sent.pop(str(getattr(meta.remote, "request_id", "")), [])
        return refusal(value, offset, time.perf_counter() if now is None else now,
                       self.margin, sent, self._extension.pop(req_id, 0.0))

    def prune(self, alive: Container[str]) -> None:
        """Forget requests that are no longer being received."""
        for rid in [r for r in self._expires if r not in alive]:
            del self._expires[rid]
            self._extension.pop(rid, None)

    @staticmethod
    def log(req_id: str, engine_id: str, why: str) -> None:
        logger.error("kvstage lease check: not reading request %s from engine %s: %s. "
                     "Failing its KV load (kv_load_failure_policy applies)",
                     req_id, engine_id, why)
