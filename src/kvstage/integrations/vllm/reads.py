"""Merged READ descriptors inside vLLM's NIXL worker: one descriptor per run per region.

vLLM 0.32.0's worker prepares, per side, one NIXL descriptor per (region, block)
(``prep_xfer_dlist``) and posts each READ as ``make_prepped_xfer("READ", local_handle,
local_ids, remote_handle, remote_ids, notif_msg=...)``: a request of n blocks over r
regions hands NIXL r x n descriptor pairs. kvstage's roles post one descriptor per run of
blocks consecutive on both sides (`kvstage.pd.reads.pair_runs`); this module gives vLLM's
worker the same, without touching its read path (its notifications, timeouts, failure
handling and handle bookkeeping stay vLLM's).

Contract
--------
`MergedReads(agent, merge=..., log_reads=...).install()` wraps five methods of the one
NIXL agent object vLLM's worker holds (``worker.nixl_wrapper``; instance attributes, the
class is untouched; each wrapper calls whatever was there before, so other wrappers
chain):
- ``get_xfer_descs(descs, mem_type)`` / ``prep_xfer_dlist(agent_name, xfer_list, ...)``:
  remember, per prepared list, its rows (``[N, 3]`` addr, len, device), memory type and
  agent (vLLM builds its lists from ``[N, 3]`` numpy arrays; lists built otherwise are
  not remembered, and READs over them are left as they are).
- ``release_dlist_handle``: forgets the list.
- ``make_prepped_xfer("READ", ...)`` over two remembered lists: the selected rows are
  merged (`merge_prepared`: a pair joins the previous one when, on both sides, its row is
  the next one in the list and continues it in memory; `merge_descs` is the general
  rule) and posted with ``initialize_xfer`` over the merged lists, same notification
  (``notif_msg``, left as given: another wrapper may have sealed it). Errors propagate to
  vLLM's caller (its failure path). Anything else (another operation, ``backends``,
  unknown lists, ``merge=False``) is vLLM's call unchanged.
- ``get_xfer_telemetry(handle)``: records NIXL's figures (bytes, post and transfer
  microseconds, NIXL's own descriptor count) for the READs posted here.

`merge_descs` is pure numpy. Per READ, `ReadRecord` keeps what was handed to NIXL
(``descriptors``; ``per_block``: vLLM's count) and the posting time (the wrapper's call:
merging, the two lists and ``initialize_xfer``, or vLLM's ``make_prepped_xfer``), in a
bounded deque; with ``log_reads`` each READ is logged when its telemetry arrives (tests and
benches read the engine's log). Threads: vLLM calls these from its worker thread only.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

MERGE_READS_KEY = "kvstage_merge_reads"
LOG_READS_KEY = "kvstage_log_reads"
LOG_PREFIX = "kvstage READ"
#: one logged READ line (``kvstage_log_reads``): merged, descriptors, per_block, post_ns,
#: bytes, xfer_us, nixl_post_us, nixl_descs as groups 1-8 (what the benches parse)
READ_LOG = re.compile(
    LOG_PREFIX + r" notif=\S* merged=(\w+) descriptors=(\d+) per_block=(\d+) post_ns=(\d+) "
    r"bytes=(\d+) xfer_us=(\d+) nixl_post_us=(\d+) nixl_descs=(\d+)"
)
MAX_RECORDS = 256


def merge_descs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge READ descriptor pairs ``[N, 3]`` (addr, len, device) into runs.

    Pair i joins pair i-1 when, on both sides, it starts where i-1 ends on the same
    device; the merged pair keeps the first address and sums the lengths. The bytes read
    and where they land are unchanged: ``[(a, 8), (a+8, 8)] / [(b, 8), (b+8, 8)]`` ->
    ``[(a, 16)] / [(b, 16)]``; a remote gap, or a local one, keeps two descriptors.
    """
    local = np.asarray(local, dtype=np.uint64)
    remote = np.asarray(remote, dtype=np.uint64)
    if local.shape != remote.shape or local.ndim != 2 or local.shape[1] != 3:
        raise ValueError(
            f"descriptor lists must be two [N, 3] arrays of one shape, got {local.shape} "
            f"and {remote.shape}"
        )
    if local.shape[0] < 2:
        return local, remote
    joins = np.ones(local.shape[0] - 1, dtype=bool)
    for side in (local, remote):
        joins &= side[:-1, 0] + side[:-1, 1] == side[1:, 0]
        joins &= side[:-1, 2] == side[1:, 2]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = []
    for side in (local, remote):
        merged = side[starts]  # a copy (fancy indexing)
        merged[:, 1] = np.add.reduceat(side[:, 1], starts)
        out.append(merged)
    return out[0], out[1]


@dataclass
class _List:
    rows: np.ndarray  # [N, 3] uint64 (addr, len, device)
    mem_type: str
    agent: str  # "NIXL_INIT_AGENT" for ours, else the remote agent's name
    #: [N] bool: row i + 1 starts where row i ends, on the same device (last: False)
    continues: np.ndarray


def _continues(rows: np.ndarray) -> np.ndarray:
    out = np.zeros(rows.shape[0], dtype=bool)
    out[:-1] = (rows[:-1, 0] + rows[:-1, 1] == rows[1:, 0]) & (rows[:-1, 2] == rows[1:, 2])
    return out


def merge_prepared(local: _List, lidx: np.ndarray, remote: _List, ridx: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """`merge_descs` of ``local.rows[lidx]`` / ``remote.rows[ridx]`` for pairs whose rows
    are neighbours in their lists (vLLM's region-major lists: consecutive blocks of one
    region), without gathering every row: the continuity of each list is computed once,
    when it is prepared. Rows that continue each other in memory but not in the list stay
    apart (fewer merges, the same bytes)."""
    n = lidx.shape[0]
    if n == 0:
        return local.rows[:0], remote.rows[:0]
    starts = np.ones(n, dtype=bool)
    lprev, rprev = lidx[:-1], ridx[:-1]
    starts[1:] = ~((lidx[1:] == lprev + 1) & (ridx[1:] == rprev + 1)
                   & local.continues[lprev] & remote.continues[rprev])
    first = np.flatnonzero(starts)
    out = []
    for lst, idx in ((local, lidx), (remote, ridx)):
        merged = lst.rows[idx[first]]
        merged[:, 1] = np.add.reduceat(lst.rows[idx, 1], first)
        out.append(merged)
    return out[0], out[1]


@dataclass
class ReadRecord:
    """One READ posted through the wrapper (figures filled in as they arrive)."""

    notif: bytes
    per_block: int  # descriptor pairs vLLM asked for
    descriptors: int  # descriptor pairs handed to NIXL
    post_ns: int  # the posting call (see the module doc)
    merged: bool
    local_idx: np.ndarray  # vLLM's descriptor indices (tests pair them into runs)
    remote_idx: np.ndarray
    nbytes: int = 0  # from NIXL's telemetry, once DONE
    xfer_us: int = 0
    nixl_post_us: int = 0
    nixl_descs: int = 0


class MergedReads:
    """Wraps a NIXL agent's methods so vLLM's prepared READs post merged descriptors."""

    def __init__(self, agent: Any, *, merge: bool = True, log_reads: bool = False,
                 logger: logging.Logger | None = None) -> None:
        self.agent = agent
        self.merge = merge
        self.log_reads = log_reads
        self.logger = logger or logging.getLogger(__name__)
        self.records: collections.deque[ReadRecord] = collections.deque(maxlen=MAX_RECORDS)
        self._lists: dict[int, tuple[Any, _List]] = {}  # id(handle) -> (handle, list)
        self._last_descs: tuple[Any, np.ndarray, str] | None = None
        self._posted: dict[int, ReadRecord] = {}  # id(xfer handle) -> its record
        self._orig: dict[str, Callable[..., Any]] = {}

    def install(self) -> MergedReads:
        for name in ("get_xfer_descs", "prep_xfer_dlist", "release_dlist_handle",
                     "make_prepped_xfer", "get_xfer_telemetry"):
            self._orig[name] = getattr(self.agent, name)
            setattr(self.agent, name, getattr(self, f"_{name}"))
        return self

    # -- remembering prepared lists ------------------------------------------------------
    def _get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Any:
        dlist = self._orig["get_xfer_descs"](descs, mem_type)
        if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3 \
                and mem_type is not None:
            self._last_descs = (dlist, descs, mem_type)
        return dlist

    def _prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: str | None = None,
                         backends: list[str] | None = None) -> Any:
        handle = self._orig["prep_xfer_dlist"](agent_name, xfer_list, mem_type, backends or [])
        rows: np.ndarray | None = None
        last = self._last_descs
        if last is not None and xfer_list is last[0]:
            rows, mem_type = last[1], last[2]
        elif isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 \
                and xfer_list.shape[1] == 3 and mem_type is not None:
            rows = xfer_list
        self._last_descs = None
        if rows is not None and mem_type is not None:
            agent = "NIXL_INIT_AGENT" if agent_name in ("", "NIXL_INIT_AGENT") else agent_name
            table = np.ascontiguousarray(rows, dtype=np.uint64)
            lst = _List(table, mem_type, agent, _continues(table))
            self._lists[id(handle)] = (handle, lst)
        return handle

    def _release_dlist_handle(self, handle: Any) -> Any:
        self._lists.pop(id(handle), None)
        return self._orig["release_dlist_handle"](handle)

    # -- posting ---------------------------------------------------------------------------
    def _make_prepped_xfer(self, operation: str, local_xfer_side: Any, local_indices: Any,
                           remote_xfer_side: Any, remote_indices: Any, notif_msg: bytes = b"",
                           backends: list[str] | None = None,
                           skip_desc_merge: bool = False) -> Any:
        start = time.perf_counter_ns()
        local = self._lists.get(id(local_xfer_side))
        remote = self._lists.get(id(remote_xfer_side))
        mine = operation == "READ" and not backends and local is not None and remote is not None
        lidx = np.asarray(local_indices, dtype=np.int64)
        ridx = np.asarray(remote_indices, dtype=np.int64)
        if not (mine and self.merge):
            handle = self._orig["make_prepped_xfer"](
                operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
                notif_msg, backends or [], skip_desc_merge)
            if mine:
                self._record(handle, notif_msg, len(lidx), len(lidx), start, False, lidx, ridx)
            return handle
        assert local is not None and remote is not None
        lrows, rrows = merge_prepared(local[1], lidx, remote[1], ridx)
        to_list = self._orig["get_xfer_descs"]
        handle = self.agent.initialize_xfer(
            "READ", to_list(lrows, local[1].mem_type), to_list(rrows, remote[1].mem_type),
            remote[1].agent, notif_msg)
        self._record(handle, notif_msg, len(lidx), len(lrows), start, True, lidx, ridx)
        return handle

    def _record(self, handle: Any, notif: bytes, per_block: int, descriptors: int, start: int,
                merged: bool, lidx: np.ndarray, ridx: np.ndarray) -> None:
        rec = ReadRecord(bytes(notif), per_block, descriptors, time.perf_counter_ns() - start,
                         merged, lidx, ridx)
        self.records.append(rec)
        if len(self._posted) > 4 * MAX_RECORDS:  # handles never polled to DONE
            self._posted.clear()
        self._posted[id(handle)] = rec

    def _get_xfer_telemetry(self, handle: Any) -> Any:
        res = self._orig["get_xfer_telemetry"](handle)
        rec = self._posted.pop(id(handle), None)
        if rec is not None and res is not None:
            rec.nbytes = int(getattr(res, "totalBytes", 0))
            rec.xfer_us = int(getattr(res, "xferDuration", 0))
            rec.nixl_post_us = int(getattr(res, "postDuration", 0))
            rec.nixl_descs = int(getattr(res, "descCount", 0))
            if self.log_reads:
                self.logger.info(
                    "%s notif=%s merged=%s descriptors=%d per_block=%d post_ns=%d bytes=%d "
                    "xfer_us=%d nixl_post_us=%d nixl_descs=%d local_idx=%s remote_idx=%s",
                    LOG_PREFIX, rec.notif.decode(errors="replace"), rec.merged,
                    rec.descriptors, rec.per_block, rec.post_ns, rec.nbytes, rec.xfer_us,
                    rec.nixl_post_us, rec.nixl_descs, ",".join(map(str, rec.local_idx.tolist())),
                    ",".join(map(str, rec.remote_idx.tolist())))
        return res


def install_merged_reads(agent: Any, extra_config: Any, logger: logging.Logger) -> MergedReads:
    """`MergedReads` over vLLM's agent, configured from ``kv_connector_extra_config``
    (``kvstage_merge_reads``, default False: NIXL 1.5.1's ``make_prepped_xfer`` merges vLLM's
    per-block pairs itself, at a third of the posting cost, BENCHMARKS.md "Inside vLLM";
    ``kvstage_log_reads``, default False)."""
    merge = extra_config.get(MERGE_READS_KEY, False)
    log_reads = extra_config.get(LOG_READS_KEY, False)
    for key, value in ((MERGE_READS_KEY, merge), (LOG_READS_KEY, log_reads)):
        if not isinstance(value, bool):
            raise ValueError(
                f"kv_connector_extra_config {key!r} must be true or false, got {value!r}"
            )
    return MergedReads(agent, merge=merge, log_reads=log_reads, logger=logger).install()
