"""kvstage's transfer figures in vLLM's KV connector stats: the periodic log and ``/metrics``.

Contract
--------
vLLM (0.32.0) carries a connector's figures from each worker rank to the front end as a
plain dict (`KVConnectorStats.data`, through ``get_kv_connector_stats``), aggregates the
ranks' dicts, logs ``reduce()`` every stats interval ("KV Transfer metrics: ...") and hands
the dict to the connector class's ``build_prom_metrics`` for ``/metrics``.

`KVStageStats` (all values lists: they aggregate by extending, ranks included):

- per prefill request, at its hold (the prompt's last step): the blocks and bytes its d2h
  copied over all its chunks, the copies' seconds, and the blocks and seconds of the last
  step alone (``d2h_last_step_blocks``, ``d2h_wait_seconds``: the d2h on TTFT's path; the
  earlier chunks' blocks were copied while later chunks computed);
- per decode request, when its READ and h2d are over: blocks, bytes and seconds of the h2d
  (``h2d_*``, posted READ to last load), and of the READ itself: bytes, seconds (posted to
  last chunk DONE), NIXL descriptors; a failed load is one ``read_failures`` entry;
- ``copy_failures``: d2h copies that raised;
- `hook_time`'s ``[hook, seconds, calls]`` and ``[side, steps]`` of quiet steps (steps in
  which the connector had nothing to do), about once a second.

A rank's bytes are its own shard's: at tensor-parallel size N the figures are N ranks'
sums (the bytes every rank moved). `KVStagePromMetrics` turns them into counters and
histograms named ``vllm:kvstage_*`` (`METRICS` lists them with their meaning). The line
``kvstage_log_reads`` writes per READ is `config.READ_LOG`.

No thread, no lock: a rank's stats are written and handed out by its worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvstage.integrations.vllm.hook_time import HOOK_KEY

QUIET_KEY = "kvstage_quiet_steps"  # [side, steps] entries
#: list keys of the stats dict; each one a counter (its sum) or histogram on /metrics
KEYS = (
    "d2h_blocks", "d2h_bytes", "d2h_seconds", "d2h_last_step_blocks", "d2h_wait_seconds",
    "h2d_blocks", "h2d_bytes", "h2d_seconds", "read_bytes", "read_seconds",
    "read_descriptors", "read_failures", "copy_failures", HOOK_KEY, QUIET_KEY,
)
#: /metrics name (less ``vllm:kvstage_``) -> (stats key, kind, help)
METRICS: dict[str, tuple[str, str, str]] = {
    "d2h_bytes": ("d2h_bytes", "counter", "KV bytes copied device to host (prefill)."),
    "d2h_blocks": ("d2h_blocks", "counter", "KV blocks copied device to host (prefill)."),
    "d2h_time_seconds": ("d2h_seconds", "histogram",
                         "Seconds of d2h copies per prefill request (all its chunks)."),
    "d2h_last_step_blocks": ("d2h_last_step_blocks", "counter",
                             "KV blocks copied in the step a prompt completed (TTFT's path)."),
    "d2h_wait_seconds": ("d2h_wait_seconds", "counter",
                         "Seconds prompts' last steps spent on their d2h (TTFT's path)."),
    "h2d_bytes": ("h2d_bytes", "counter", "KV bytes copied host to device (decode)."),
    "h2d_blocks": ("h2d_blocks", "counter", "KV blocks copied host to device (decode)."),
    "h2d_time_seconds": ("h2d_seconds", "histogram",
                         "Seconds from a request's READ posted to its last h2d done."),
    "read_bytes": ("read_bytes", "counter", "KV bytes READ from prefill host buffers."),
    "read_time_seconds": ("read_seconds", "histogram",
                          "Seconds per request's READ, posted to last chunk DONE."),
    "read_descriptors": ("read_descriptors", "counter", "NIXL descriptors the READs posted."),
    "read_failures": ("read_failures", "counter",
                      "KV loads that failed (vLLM's kv_load_failure_policy applied)."),
    "copy_failures": ("copy_failures", "counter", "d2h copies that raised."),
}
BUCKETS = [1e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0]


@dataclass
class KVStageStats(KVConnectorStats):
    """One rank's (or the aggregated ranks') figures since the last hand-out (module doc)."""

    def __post_init__(self) -> None:
        for key in KEYS:  # a dict from another sender may lack some
            self.data.setdefault(key, [])

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {key: [] for key in KEYS}

    def add(self, **values: Any) -> None:
        for key, value in values.items():
            self.data[key].append(value)

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, values in other.data.items():
            self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        for way in ("d2h", "h2d"):
            out[f"kvstage {way} copies"] = len(d[f"{way}_bytes"])
            out[f"kvstage {way} MB"] = round(sum(d[f"{way}_bytes"]) / 2**20, 3)
            out[f"kvstage {way} time (ms)"] = round(sum(d[f"{way}_seconds"]) * 1e3, 3)
        out["kvstage d2h last-step blocks"] = sum(d["d2h_last_step_blocks"])
        out["kvstage d2h wait (ms)"] = round(sum(d["d2h_wait_seconds"]) * 1e3, 3)
        out["kvstage READs"] = len(d["read_bytes"])
        out["kvstage READ MB"] = round(sum(d["read_bytes"]) / 2**20, 3)
        seconds = sum(d["read_seconds"])
        out["kvstage READ GB/s"] = round(sum(d["read_bytes"]) / seconds / 1e9, 3) if seconds else 0
        out["kvstage READ failures"] = len(d["read_failures"])
        out["kvstage copy failures"] = len(d["copy_failures"])
        out["kvstage hook time (ms)"] = round(sum(e[1] for e in d[HOOK_KEY]) * 1e3, 3)
        out["kvstage quiet steps"] = sum(e[1] for e in d[QUIET_KEY])
        return out


class KVStagePromMetrics(KVConnectorPromMetrics):
    """`METRICS` per engine, plus the per-hook times and per-side quiet steps."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM hands the metric classes to use, keyed by prometheus_client's
        counter_cls, histogram_cls = metric_types[Counter], metric_types[Histogram]
        self.metrics: dict[str, tuple[str, str, Any]] = {}
        for name, (key, kind, doc) in METRICS.items():
            if kind == "histogram":
                metric = histogram_cls(name=f"vllm:kvstage_{name}", documentation=doc,
                                             buckets=BUCKETS, labelnames=labelnames)
            else:
                metric = counter_cls(name=f"vllm:kvstage_{name}", documentation=doc,
                                           labelnames=labelnames)
            self.metrics[name] = (key, kind,
                                  create_metric_per_engine(metric, per_engine_labelvalues))
        self.hook_seconds = counter_cls(
            name="vllm:kvstage_hook_seconds", labelnames=[*labelnames, "hook"],
            documentation="Wall seconds the connector spent in each vLLM hook "
                          "(kvstage_time_hooks; hook: scheduler.<name> or worker.<name>).")
        self.hook_calls = counter_cls(
            name="vllm:kvstage_hook_calls", labelnames=[*labelnames, "hook"],
            documentation="Calls vLLM made to each connector hook (kvstage_time_hooks).")
        self.quiet_steps = counter_cls(
            name="vllm:kvstage_quiet_steps", labelnames=[*labelnames, "side"],
            documentation="Engine steps in which the connector had nothing to do "
                          "(side: scheduler or worker).")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, kind, per_engine in self.metrics.values():
            metric = per_engine[engine_idx]
            for value in transfer_stats_data.get(key, ()):
                if kind == "histogram":
                    metric.observe(value)
                else:
                    metric.inc(value)
        labels = self.per_engine_labelvalues[engine_idx]
        for hook, seconds, calls in transfer_stats_data.get(HOOK_KEY, ()):
            self.hook_seconds.labels(*labels, str(hook)).inc(seconds)
            self.hook_calls.labels(*labels, str(hook)).inc(calls)
        for side, steps in transfer_stats_data.get(QUIET_KEY, ()):
            self.quiet_steps.labels(*labels, str(side)).inc(steps)
