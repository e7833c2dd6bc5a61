"""kvstage's transfer figures in vLLM's KV connector stats: periodic log and ``/metrics``.

Contract
--------
vLLM (0.32.0) carries a connector's figures from the worker to the front end as a plain
dict (`KVConnectorStats.data`), logs them every stats interval ("KV Transfer metrics: ...")
and records them in Prometheus through the connector class's ``build_prom_metrics``. The
NIXL connector already records each READ (bytes, transfer and post time, descriptors, from
NIXL's telemetry) and its failures; `KVStageConnector` inherits that. This module adds what
only kvstage does, the copies between the device KV cache and the host buffers:

- `KVStageStats(NixlKVConnectorStats)`: vLLM's NIXL lists plus, per copy call, its blocks,
  bytes and seconds for ``d2h`` (prefill, into the host buffer) and ``h2d`` (decode, out of
  it), and a list of failed copies. ``reduce`` (the log line) adds MB and ms for both
  directions; ``is_empty`` is False when only copies happened (a prefill never READs, so
  vLLM's own test would drop all of its figures).
- `KVStagePromMetrics(NixlPromMetrics)`: vLLM's ``vllm:nixl_*`` metrics plus counters
  ``vllm:kvstage_{d2h,h2d}_bytes_total``, ``vllm:kvstage_{d2h,h2d}_blocks_total`` and
  ``vllm:kvstage_d2h_last_step_blocks_total`` (the blocks prompts' last steps copied) and
  ``vllm:kvstage_d2h_wait_seconds_total`` (how long those steps waited for their d2h),
  histograms ``vllm:kvstage_{d2h,h2d}_time_seconds`` (``_sum`` is the total copy time,
  ``_count`` the number of copies: one per request on vLLM's host path), the counter
  ``vllm:kvstage_copy_failures_total``, and per hook (label ``hook``) the counters
  ``vllm:kvstage_hook_seconds_total`` / ``vllm:kvstage_hook_calls_total`` of `hook_time`
  and per side (label ``side``) ``vllm:kvstage_quiet_steps_total`` of `quiet` (the entries
  reach the stats about once a second, from either side; the hook times only with
  ``kvstage_time_hooks``).
- `MeteredCopy`: wraps kvstage's copy op (vLLM's ``CopyBlocksOp`` signature), the worker's
  ``copy_blocks``, and records each call into the worker's own `KVStageStats` of copies;
  it re-raises a copy's error after counting it. vLLM's stats object (``xfer_stats``) is
  left as vLLM made it: `with_copies` joins the two when vLLM asks the connector for its
  stats (``get_kv_connector_stats``), once per step.
- `log_reads` (``kvstage_log_reads``): one `READ_LOG` line per READ vLLM recorded (NIXL's
  telemetry: bytes, transfer and post microseconds, descriptors after NIXL's merging).

Bytes: a copy's bytes are its distinct destination block ids times the block bytes of the
layout, the sum over the distinct KV views (storage, offset, dtype, shape, stride: aliased
layer names counted once) of one block's bytes (blocks lie on dim 0 in vLLM 0.32.0's
layouts). They are the bytes the request's blocks hold, whatever the copy implementation
does to move them. Seconds: an h2d's are wall time around the call (complete on return,
CUDA included); a prefill's d2h is one record per request at its prompt's last step, its
seconds the copies' own time, most of it in the background (`chunk_saves`).

Threads: the copy and ``get_kv_connector_stats`` both run on the worker's step thread (vLLM
calls them from ``execute_model``); nothing here locks or starts a thread.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (
    NixlKVConnectorStats,
    NixlPromMetrics,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvstage.integrations.vllm.hook_time import HOOK_KEY
from kvstage.integrations.vllm.quiet import QUIET_KEY

DIRECTIONS = ("d2h", "h2d")
#: per prefill request, the blocks its prompt's last step copied (on TTFT's path; the
#: others were copied in the background while later chunks ran: `chunk_saves`)
LAST_STEP_KEY = "kvstage_d2h_last_step_blocks"
#: per prefill request, the seconds its prompt's last step spent on its d2h (the d2h on
#: TTFT's path: the last chunk's copy, and any earlier one still running on CUDA)
WAIT_KEY = "kvstage_d2h_wait_seconds"
#: the keys kvstage adds to vLLM's NIXL stats dict (lists: one entry per copy call, and
#: `hook_time`'s [hook, seconds, calls] per hook and `quiet`'s [side, quiet steps] about
#: once a second)
COPY_KEYS = tuple(
    f"kvstage_{d}_{what}" for d in DIRECTIONS for what in ("blocks", "bytes", "seconds")
) + ("kvstage_copy_failures", LAST_STEP_KEY, WAIT_KEY, HOOK_KEY, QUIET_KEY)


def block_bytes(caches: Mapping[str, torch.Tensor]) -> int:
    """Bytes of one block over the distinct views of ``caches`` (aliases counted once)."""
    seen: dict[tuple[Any, ...], int] = {}
    for t in caches.values():
        key = (
            t.untyped_storage().data_ptr(),
            int(t.storage_offset()),
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
        )
        seen[key] = t[0].numel() * t.element_size()
    return sum(seen.values())


class KVStageStats(NixlKVConnectorStats):
    """vLLM's NIXL stats plus kvstage's d2h/h2d copies (all lists: they aggregate by extend)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in COPY_KEYS:  # a dict from an older sender may lack them
            self.data.setdefault(key, [])

    def reset(self) -> None:
        super().reset()
        for key in COPY_KEYS:
            self.data[key] = []

    def record_copy(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.data[f"kvstage_{direction}_blocks"].append(blocks)
        self.data[f"kvstage_{direction}_bytes"].append(nbytes)
        self.data[f"kvstage_{direction}_seconds"].append(seconds)

    def record_last_step(self, blocks: int, wait_s: float) -> None:
        self.data[LAST_STEP_KEY].append(blocks)
        self.data[WAIT_KEY].append(wait_s)

    def record_failed_copy(self) -> None:
        self.data["kvstage_copy_failures"].append(1)

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data[k] for k in COPY_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        for d in DIRECTIONS:
            nbytes = sum(self.data[f"kvstage_{d}_bytes"])
            out[f"kvstage {d} copies"] = len(self.data[f"kvstage_{d}_bytes"])
            out[f"kvstage {d} MB"] = round(nbytes / 2**20, 3)
            out[f"kvstage {d} time (ms)"] = round(sum(self.data[f"kvstage_{d}_seconds"]) * 1e3, 3)
        out["kvstage d2h last-step blocks"] = sum(self.data[LAST_STEP_KEY])
        out["kvstage d2h wait (ms)"] = round(sum(self.data[WAIT_KEY]) * 1e3, 3)
        out["kvstage copy failures"] = len(self.data["kvstage_copy_failures"])
        out["kvstage hook time (ms)"] = round(sum(e[1] for e in self.data[HOOK_KEY]) * 1e3, 3)
        out["kvstage quiet steps"] = sum(e[1] for e in self.data[QUIET_KEY])
        return out


class KVStagePromMetrics(NixlPromMetrics):
    """vLLM's NIXL Prometheus metrics plus kvstage's copy counters and histograms."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # copies of a few blocks take tens of microseconds on CPU, a large prompt's
        # hundreds of milliseconds through pinned memory
        buckets = [1e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]

        def per_engine(metric: Any) -> Any:
            return create_metric_per_engine(metric, self.per_engine_labelvalues)

        self.kvstage_bytes: dict[str, Any] = {}
        self.kvstage_blocks: dict[str, Any] = {}
        self.kvstage_time: dict[str, Any] = {}
        for d, what in (("d2h", "device to host (prefill)"), ("h2d", "host to device (decode)")):
            self.kvstage_bytes[d] = per_engine(self._counter_cls(
                name=f"vllm:kvstage_{d}_bytes",
                documentation=f"KV bytes kvstage copied {what}.",
                labelnames=labelnames,
            ))
            self.kvstage_blocks[d] = per_engine(self._counter_cls(
                name=f"vllm:kvstage_{d}_blocks",
                documentation=f"KV blocks kvstage copied {what}.",
                labelnames=labelnames,
            ))
            self.kvstage_time[d] = per_engine(self._histogram_cls(
                name=f"vllm:kvstage_{d}_time_seconds",
                documentation=f"Seconds per kvstage KV copy {what} (one per request).",
                buckets=buckets,
                labelnames=labelnames,
            ))
        self.kvstage_last_step_blocks = per_engine(self._counter_cls(
            name="vllm:kvstage_d2h_last_step_blocks",
            documentation="KV blocks kvstage copied device to host in the step a prompt "
                          "completed (on TTFT's path; the rest ran while later chunks did).",
            labelnames=labelnames,
        ))
        self.kvstage_wait = per_engine(self._counter_cls(
            name="vllm:kvstage_d2h_wait_seconds",
            documentation="Seconds prompts' last steps waited for their d2h (on TTFT's "
                          "path).",
            labelnames=labelnames,
        ))
        self.kvstage_copy_failures = per_engine(self._counter_cls(
            name="vllm:kvstage_copy_failures",
            documentation="kvstage KV copies (d2h or h2d) that raised.",
            labelnames=labelnames,
        ))
        hook_labels = [*labelnames, "hook"]
        self.kvstage_hook_seconds = self._counter_cls(
            name="vllm:kvstage_hook_seconds",
            documentation="Wall seconds the connector spent in each vLLM hook (its cost "
                          "per engine step; hook: scheduler.<name> or worker.<name>).",
            labelnames=hook_labels,
        )
        self.kvstage_hook_calls = self._counter_cls(
            name="vllm:kvstage_hook_calls",
            documentation="Calls vLLM made to each connector hook.",
            labelnames=hook_labels,
        )
        self.kvstage_quiet_steps = self._counter_cls(
            name="vllm:kvstage_quiet_steps",
            documentation="Engine steps in which the connector skipped vLLM's NIXL "
                          "bookkeeping (no transfer in flight; side: scheduler or worker).",
            labelnames=[*labelnames, "side"],
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for d in DIRECTIONS:
            for n in transfer_stats_data.get(f"kvstage_{d}_bytes", ()):
                self.kvstage_bytes[d][engine_idx].inc(n)
            for n in transfer_stats_data.get(f"kvstage_{d}_blocks", ()):
                self.kvstage_blocks[d][engine_idx].inc(n)
            for s in transfer_stats_data.get(f"kvstage_{d}_seconds", ()):
                self.kvstage_time[d][engine_idx].observe(s)
        for n in transfer_stats_data.get(LAST_STEP_KEY, ()):
            self.kvstage_last_step_blocks[engine_idx].inc(n)
        for s in transfer_stats_data.get(WAIT_KEY, ()):
            self.kvstage_wait[engine_idx].inc(s)
        for n in transfer_stats_data.get("kvstage_copy_failures", ()):
            self.kvstage_copy_failures[engine_idx].inc(n)
        labels = self.per_engine_labelvalues[engine_idx]
        for hook, seconds, calls in transfer_stats_data.get(HOOK_KEY, ()):
            self.kvstage_hook_seconds.labels(*labels, str(hook)).inc(seconds)
            self.kvstage_hook_calls.labels(*labels, str(hook)).inc(calls)
        for side, steps in transfer_stats_data.get(QUIET_KEY, ()):
            self.kvstage_quiet_steps.labels(*labels, str(side)).inc(steps)


CopyOp = Callable[..., None]


class MeteredCopy:
    """A ``CopyBlocksOp`` that records blocks, bytes, seconds and failures of ``op``.

    ``stats``: where the calls are recorded (`with_copies` takes them out each step).
    """

    def __init__(self, op: CopyOp, stats: KVStageStats) -> None:
        self.op = op
        self.stats = stats
        self._block_bytes: dict[int, int] = {}  # id(dst caches) -> block bytes

    def __call__(
        self,
        src_caches: Mapping[str, torch.Tensor],
        dst_caches: Mapping[str, torch.Tensor],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        direction: str,
    ) -> None:
        start = time.perf_counter()
        try:
            self.op(src_caches, dst_caches, src_block_ids, dst_block_ids, direction)
        except BaseException:
            self.stats.record_failed_copy()
            raise
        seconds = time.perf_counter() - start
        if direction not in DIRECTIONS:
            return
        # kvstage's op knows what one id moves (whole logical pages of every tensor); for
        # another op, the distinct views' first blocks
        per_block = getattr(self.op, "block_bytes", None) or self._block_bytes.get(id(dst_caches))
        if per_block is None:  # the caches live as long as the worker: compute once
            per_block = self._block_bytes[id(dst_caches)] = block_bytes(dst_caches)
        blocks = len(set(dst_block_ids))
        self.stats.record_copy(direction, blocks, blocks * per_block, seconds)


def with_copies(nixl: KVConnectorStats | None, copies: KVStageStats) -> KVStageStats | None:
    """One step's stats for vLLM: its NIXL figures (``nixl``, what vLLM's worker returns
    from ``get_kv_connector_stats``: None when it saw nothing) plus the copies recorded in
    ``copies`` since the last call (which is reset); None when both are empty."""
    if nixl is None and copies.is_empty():
        return None
    out = KVStageStats(data=dict(nixl.data) if nixl is not None else {})
    for key in COPY_KEYS:
        out.data[key] = list(copies.data[key])
    copies.reset()
    return out


LOG_PREFIX = "kvstage READ"
#: one logged READ line (``kvstage_log_reads``): bytes, xfer_us, nixl_post_us, nixl_descs
#: as groups 1-4 (what the benches parse): NIXL's telemetry of that READ, as vLLM recorded it
READ_LOG = re.compile(
    LOG_PREFIX + r" bytes=(\d+) xfer_us=(\d+) nixl_post_us=(\d+) nixl_descs=(\d+)"
)


def log_reads(stats: KVConnectorStats | None, logger: Any) -> None:
    """``kvstage_log_reads``: one `READ_LOG` line per READ in vLLM's stats of a step."""
    if stats is None:
        return
    data = stats.data
    for nbytes, xfer, post, descs in zip(
        data.get("bytes_transferred", ()), data.get("transfer_duration", ()),
        data.get("post_duration", ()), data.get("num_descriptors", ()), strict=False,
    ):
        logger.info("%s bytes=%d xfer_us=%d nixl_post_us=%d nixl_descs=%d", LOG_PREFIX,
                    int(nbytes), round(xfer * 1e6), round(post * 1e6), int(descs))
