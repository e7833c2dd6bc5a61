"""`quiet`: which worker steps and scheduler builds skip vLLM's NIXL bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvstage.integrations.vllm.quiet import (
    FIELDS,
    Pauses,
    QuietBuilds,
    QuietSteps,
    carries_work,
    take,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def meta(**fields: Any) -> SimpleNamespace:
    """A step's metadata as vLLM's NIXL scheduler builds it (every field empty)."""
    out = SimpleNamespace(reqs_to_recv={}, reqs_to_save={}, reqs_to_send={},
                          reqs_in_batch=set(), reqs_not_processed=set(),
                          heartbeat_by_engine={}, requests={}, saves_final={},
                          saves_dropped=set())
    out.__dict__.update(fields)
    return out


def recv(awaiting: bool, blocks: list[list[int]]) -> SimpleNamespace:
    return SimpleNamespace(awaiting_kvs=awaiting, local_block_ids=blocks)


def steps(quiet: QuietSteps, clock: Clock, n: int, dt: float = 1 / 64) -> list[bool]:
    """n empty steps dt apart: which were full."""
    out = []
    for _ in range(n):
        clock.t += dt
        out.append(quiet.begin(meta()))
    return out


def test_empty_steps_are_quiet_between_polls() -> None:
    clock = Clock()
    q = QuietSteps(0.125, clock)
    assert q.begin(meta()) and q.step_is_full()  # the first step polls
    # 1/64 s apart: the next full one is the first at least 1/8 s after the last
    assert steps(q, clock, 20) == ([False] * 7 + [True]) * 2 + [False] * 4
    assert not q.step_is_full()
    assert take(q) == 18 and take(q) == 0


def test_poll_zero_is_every_step_as_vllm() -> None:
    clock = Clock()
    q = QuietSteps(0.0, clock)
    assert all(steps(q, clock, 5)) and q.quiet == 0


@pytest.mark.parametrize("field", FIELDS)
def test_any_field_with_work_makes_a_full_step(field: str) -> None:
    clock = Clock()
    q = QuietSteps(0.1, clock)
    q.begin(meta())
    work: Any = {"x": recv(False, [[]])} if field == "reqs_to_recv" else {"x": 1}
    if field in ("reqs_in_batch", "reqs_not_processed", "saves_dropped"):
        work = {"x"}
    assert carries_work(meta(**{field: work}))
    clock.t += 0.001
    assert q.begin(meta(**{field: work})) and q.step_is_full()
    assert not carries_work(meta()) and not carries_work(SimpleNamespace())


def test_a_read_keeps_steps_full_until_vllm_reports_it() -> None:
    clock = Clock()
    q = QuietSteps(0.1, clock)
    q.begin(meta())
    clock.t += 0.001
    assert q.begin(meta(reqs_to_recv={"a": recv(True, [[]]), "b": recv(False, [[3]])}))
    assert q.recving == {"a", "b"}
    assert steps(q, clock, 3) == [True] * 3  # READs in flight: polled every step
    q.reported(set(), {"a"}, set())
    assert steps(q, clock, 1) == [True]
    q.reported(set(), {"b"}, {"b"})  # failed: also in finished, as vLLM reports it
    assert q.recving == set()
    assert steps(q, clock, 2) == [False, False]


def test_a_notify_only_read_is_not_tracked() -> None:
    # a full local hit: vLLM only notifies the prefill and never reports the request
    clock = Clock()
    q = QuietSteps(0.1, clock)
    q.begin(meta())
    clock.t += 0.001
    assert q.begin(meta(reqs_to_recv={"hit": recv(False, [[], []])}))
    assert q.recving == set()
    assert steps(q, clock, 2) == [False, False]


def test_a_send_keeps_steps_full_until_sent() -> None:
    clock = Clock()
    q = QuietSteps(0.1, clock)
    q.begin(meta())
    clock.t += 0.001
    assert q.begin(meta(reqs_in_batch={"p"}))
    assert q.sending == set()  # in the batch only: no notification can name it yet
    assert steps(q, clock, 1) == [False]
    assert q.begin(meta(reqs_to_send={"p": 123.0}))
    assert steps(q, clock, 3) == [True] * 3
    q.reported({"p"}, set(), set())
    assert steps(q, clock, 1) == [False]


def test_stats_are_due_once_after_a_full_step() -> None:
    clock = Clock()
    q = QuietSteps(0.1, clock)
    assert q.stats_due()  # nothing asked yet
    q.begin(meta())
    assert q.stats_due() and not q.stats_due()
    steps(q, clock, 3)
    assert not q.stats_due()
    clock.t += 0.2
    q.begin(meta())  # the first step after a pause: its poll waits a step (`Pauses`)
    assert not q.stats_due()
    clock.t += 0.001
    q.begin(meta())
    assert q.stats_due()


def test_the_first_step_after_a_pause_leaves_the_poll_to_the_next_step() -> None:
    """A new request's first token is computed in the first step after a pause: the full
    step the poll alone made due runs in the step after it, once; work runs at once."""
    clock = Clock()
    q = QuietSteps(0.125, clock)
    assert q.begin(meta())  # the very first step polls
    assert steps(q, clock, 9) == [False] * 7 + [True, False]  # back to back: no deferral
    clock.t += 5.0  # a pause
    assert steps(q, clock, 3, dt=0.002) == [False, True, False]
    # a pause, one step (deferred), another pause: that step runs the poll (once only)
    clock.t += 5.0
    assert steps(q, clock, 1) == [False]
    clock.t += 5.0
    assert steps(q, clock, 2, dt=0.002) == [True, False]
    clock.t += 5.0  # work after a pause is never deferred
    assert q.begin(meta(reqs_in_batch={"p"}))
    b = QuietBuilds(0.125, clock)  # the scheduler side shares the rule
    assert b.full() and not b.full()
    clock.t += 5.0
    assert not b.full()
    clock.t += 0.002
    assert b.full()


def test_pauses_defer_due_work_once_and_never_with_gap_zero() -> None:
    p = Pauses(1.0)
    assert not p.defer(0.0, True)  # the first call: no pause to follow
    assert not p.defer(0.5, True)  # back to back
    assert p.defer(2.0, True) and not p.defer(2.1, True)  # after a pause, once
    assert not p.defer(4.0, False)  # nothing due: nothing deferred
    assert p.defer(6.0, True)
    assert not p.defer(8.0, True)  # deferred already: the work runs now
    zero = Pauses(0.0)
    assert not zero.defer(0.0, True) and not zero.defer(9.0, True)


def test_builds_are_quiet_until_touched_or_waiting() -> None:
    clock = Clock()
    b = QuietBuilds(0.1, clock)
    assert b.full()  # the first build
    clock.t += 0.004
    assert not b.full()
    b.touch()  # a hook saw kv_transfer_params
    assert b.full() and not b.full()
    b.wait("d")  # a decode request awaits its KV: vLLM heartbeats its prefill
    assert b.full() and b.full()
    b.done(["d"])
    assert not b.full()
    assert b.full(busy=True)  # kvstage saving a prompt
    clock.t += 0.099
    assert not b.full()
    clock.t += 0.002
    assert b.full()  # the poll
    assert take(b) == 4
    assert QuietBuilds(0.0, clock).full() and QuietBuilds(0.0, clock).full()
