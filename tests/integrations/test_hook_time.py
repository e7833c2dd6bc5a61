"""`hook_time`: per-hook wall time, handed out at most once per flush interval.

Exact: nanoseconds from a scripted clock, calls per hook, the flush boundary, one record
per call (a hook calling its parent's implementation is not counted twice), a raising
hook still counted, an untimed instance (clock None) left alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvstage.integrations.vllm import hook_time
from kvstage.integrations.vllm.hook_time import (
    SCHEDULER_HOOKS,
    WORKER_HOOKS,
    HookClock,
    time_hooks,
)


class Ticks:
    """A ``perf_counter_ns`` stand-in that advances by ``step`` ns on every read."""

    def __init__(self, step: int) -> None:
        self.now, self.step = 0, step

    def __call__(self) -> int:
        self.now += self.step
        return self.now


class Base:
    def build_connector_meta(self, x: int) -> int:
        return x + 1

    def start_load_kv(self, fail: bool = False) -> None:
        if fail:
            raise RuntimeError("boom")

    def not_a_hook(self) -> str:
        return "untouched"


@time_hooks
class Timed(Base):
    def build_connector_meta(self, x: int) -> int:  # calls the parent's (unwrapped) one
        return super().build_connector_meta(x) * 10


def test_take_hands_out_totals_once_per_interval_and_resets() -> None:
    now = [0]
    clock = HookClock("worker", flush_s=1.0, clock=lambda: now[0])
    clock.add("start_load_kv", 300)
    clock.add("start_load_kv", 200)
    clock.add("wait_for_save", 7)
    now[0] = 999_999_999  # under 1 s since the last take
    assert clock.take() is None
    now[0] = 1_000_000_000
    assert clock.take() == [["worker.start_load_kv", 500e-9, 2], ["worker.wait_for_save", 7e-9, 1]]
    assert clock.take(force=True) is None  # nothing since
    clock.add("wait_for_save", 5)
    assert clock.take(force=True) == [["worker.wait_for_save", 5e-9, 1]]


def test_timed_hooks_record_wall_ns_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook_time.time, "perf_counter_ns", Ticks(250))
    t = Timed()
    t.kvstage_clock = HookClock("scheduler", clock=lambda: 0)
    assert t.build_connector_meta(1) == 20
    assert t.build_connector_meta(2) == 30
    with pytest.raises(RuntimeError, match="boom"):
        t.start_load_kv(fail=True)
    assert t.not_a_hook() == "untouched"
    assert t.kvstage_clock.calls == {"build_connector_meta": 2, "start_load_kv": 1}
    assert t.kvstage_clock.ns == {"build_connector_meta": 500, "start_load_kv": 250}


def test_an_instance_without_a_clock_is_not_timed() -> None:
    t = Timed()
    assert t.kvstage_clock is None
    assert t.build_connector_meta(0) == 10
    assert Timed.build_connector_meta.__name__ == "build_connector_meta"  # wraps keeps it


def test_only_hooks_the_class_has_are_wrapped() -> None:
    assert not hasattr(Timed, "bind_connector_metadata")
    assert "update_connector_output" in SCHEDULER_HOOKS
    assert "get_transfer_results" in WORKER_HOOKS


def test_the_connector_times_every_hook_vllm_calls() -> None:
    pytest.importorskip("vllm", reason="needs vLLM")
    from kvstage.integrations.vllm.connector import KVStageConnector

    for hook in SCHEDULER_HOOKS + WORKER_HOOKS:
        fn: Any = getattr(KVStageConnector, hook)
        assert fn.__code__ is hook_time._timed(hook, fn).__code__, hook
