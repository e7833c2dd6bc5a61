"""`kvstage.pd.lease`: the one lease decision every prefill and decode uses, exactly."""

from __future__ import annotations

from kvstage.pd import lease


def test_prefill_deadline_renews_up_to_the_hold_bound() -> None:
    assert lease.deadline(100.0, 30.0) == 130.0
    assert lease.deadline(100.0, 30.0, hold_until=120.0) == 120.0
    assert lease.expired(120.0, 120.0) and not lease.expired(120.0, 119.99)


def test_a_bounded_read_ends_before_the_lease() -> None:
    assert lease.read_budget(10.0, 4.0) == 4.0
    assert lease.read_budget(10.0, 40.0) == 10.0
