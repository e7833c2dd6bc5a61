"""`kvstage.pd.lease`: the one lease decision both decodes (the CLI's, vLLM's) use, exactly."""

from __future__ import annotations

import pytest

from kvstage.pd import lease


def test_prefill_deadline_renews_up_to_the_hold_bound() -> None:
    assert lease.deadline(100.0, 30.0) == 130.0
    assert lease.deadline(100.0, 30.0, hold_until=120.0) == 120.0
    assert lease.expired(120.0, 120.0) and not lease.expired(120.0, 119.99)


def test_time_left_maps_the_prefill_clock_through_the_offset() -> None:
    # prefill's clock runs 1000 s ahead; its deadline 1030 is local 30; at local 25: 5 left
    assert lease.time_left(1030.0, 1000.0, 25.0) == pytest.approx(5.0)


def test_a_bounded_read_ends_before_the_lease() -> None:
    assert lease.read_budget(10.0, 4.0) == 4.0
    assert lease.read_budget(10.0, 40.0) == 10.0


def test_an_unbounded_read_starts_only_outside_the_margin() -> None:
    assert lease.read_refusal(7.01, 7.0, margin_name="m") is None
    assert lease.read_refusal(3.0, 7.0, margin_name="kvstage_lease_margin_s") == (
        "the prefill's lease on its blocks ends in 3.00 s, within the 7 s margin "
        "(kvstage_lease_margin_s): the blocks may hold another request's KV by the time "
        "they are read")
    assert lease.read_refusal(-1.5, 7.0, margin_name="m").startswith(  # type: ignore[union-attr]
        "the prefill's lease on its blocks ended 1.50 s ago")
