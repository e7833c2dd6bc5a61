"""`hook_time`: per-hook wall time, on one instance, handed out at most once per interval.

Exact: nanoseconds from a scripted clock, calls per hook, the flush boundary, one record
per call, a raising hook still counted, only the clock's side's hooks wrapped, the class
and other instances left alone (untimed: the class's own methods are called, nothing
wrapped), and the connector untimed by default.
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


class Connector(Base):
    def build_connector_meta(self, x: int) -> int:  # calls the parent's (not timed again)
        return super().build_connector_meta(x) * 10

    def get_kv_connector_stats(self) -> str:  # a hook of both sides
        return "stats"


def test_due_once_per_interval_and_take_hands_out_totals_and_resets() -> None:
    now = [0]
    clock = HookClock("worker", flush_s=1.0, clock=lambda: now[0])
    assert clock.take() is None  # nothing timed
    clock.add("start_load_kv", 300)
    clock.add("start_load_kv", 200)
    clock.add("wait_for_save", 7)
    now[0] = 999_999_999  # under 1 s since the clock began
    assert not clock.due()
    now[0] = 1_000_000_000
    assert clock.due() and not clock.due()  # once, then a second later again
    assert clock.take() == [["worker.start_load_kv", 500e-9, 2], ["worker.wait_for_save", 7e-9, 1]]
    assert clock.take() is None  # nothing since
    clock.add("wait_for_save", 5)
    assert clock.take() == [["worker.wait_for_save", 5e-9, 1]]
    now[0] = 1_999_999_999
    assert not clock.due()
    now[0] = 2_000_000_000
    assert clock.due()


def test_timed_hooks_record_wall_ns_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook_time.time, "perf_counter_ns", Ticks(250))
    t = Connector()
    clock = HookClock("scheduler", clock=lambda: 0)
    time_hooks(t, clock)
    assert t.build_connector_meta(1) == 20
    assert t.build_connector_meta(2) == 30
    assert t.get_kv_connector_stats() == "stats"
    assert t.start_load_kv() is None  # a worker hook: not wrapped on the scheduler side
    assert t.not_a_hook() == "untouched"
    assert clock.calls == {"build_connector_meta": 2, "get_kv_connector_stats": 1}
    assert clock.ns == {"build_connector_meta": 500, "get_kv_connector_stats": 250}
    assert t.build_connector_meta.__name__ == "build_connector_meta"  # wraps keeps it


def test_a_raising_hook_is_counted_and_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hook_time.time, "perf_counter_ns", Ticks(100))
    t = Connector()
    clock = HookClock("worker", clock=lambda: 0)
    time_hooks(t, clock)
    with pytest.raises(RuntimeError, match="boom"):
        t.start_load_kv(fail=True)
    assert clock.calls == {"start_load_kv": 1} and clock.ns == {"start_load_kv": 100}
    assert "build_connector_meta" not in vars(t)  # a scheduler hook: not wrapped here


def test_timing_one_instance_leaves_the_class_and_others_alone() -> None:
    timed, untimed = Connector(), Connector()
    time_hooks(timed, HookClock("worker"))
    assert "start_load_kv" in vars(timed)
    assert vars(untimed) == {}
    assert not any(hasattr(f, "__wrapped__") for f in vars(Connector).values())
    assert untimed.start_load_kv.__func__ is Base.start_load_kv  # called directly
    assert "update_connector_output" in SCHEDULER_HOOKS
    assert "get_transfer_results" in WORKER_HOOKS


def test_the_connector_is_untimed_by_default_and_times_each_sides_hooks() -> None:
    pytest.importorskip("vllm", reason="needs vLLM")
    from kvstage.integrations.vllm.config import KVStageConfig
    from kvstage.integrations.vllm.connector import KVStageConnector

    assert KVStageConfig.parse({}).time_hooks is False
    assert KVStageConfig.parse({"kvstage_time_hooks": True}).time_hooks is True
    for side, hooks in (("scheduler", SCHEDULER_HOOKS), ("worker", WORKER_HOOKS)):
        conn: Any = object.__new__(KVStageConnector)
        time_hooks(conn, HookClock(side))
        assert set(vars(conn)) == set(hooks), side  # every hook vLLM calls on this side
