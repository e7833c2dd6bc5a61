"""bench.ab_stats: ratios of pooled per-round samples with paired bootstrap intervals.

Exact: identical or proportional servers give degenerate intervals at the exact ratio (the
rounds are resampled in pairs); each statistic is the ratio of that statistic of the
pooled samples; an observed ratio lies inside its interval; unpaired or single rounds give
NaN intervals, not a number."""

from __future__ import annotations

import math

import numpy as np

from bench.ab_stats import STATS, across_starts, ratios

BASE = [[3.0, 3.5, 2.9], [2.5, 4.0, 3.3], [4.1, 3.0, 2.8], [3.2, 3.1, 6.0], [2.7, 3.6, 3.4]]


def test_identical_and_proportional_servers_give_exact_degenerate_intervals() -> None:
    assert ratios(BASE, BASE) == {name: [1.0, 1.0, 1.0] for name in STATS}
    doubled = [[2 * v for v in r] for r in BASE]
    assert ratios(BASE, doubled) == {name: [2.0, 2.0, 2.0] for name in STATS}


def test_each_statistic_is_the_ratio_of_the_pooled_samples() -> None:
    other = [[3.0, 3.0, 3.0]] * 4 + [[9.0, 3.0, 3.0]]
    got = ratios(BASE, other)
    pooled_a, pooled_b = np.concatenate(BASE), np.concatenate(other)
    assert got["mean"][0] == round(pooled_b.mean() / pooled_a.mean(), 4)
    assert got["p10"][0] == round(np.percentile(pooled_b, 10) / np.percentile(pooled_a, 10), 4)
    assert got["p90"][0] == round(np.percentile(pooled_b, 90) / np.percentile(pooled_a, 90), 4)
    for name, (whole, low, high) in got.items():
        assert low <= whole <= high, name
    assert got["mean"][1] < got["mean"][2]  # a real spread: the rounds differ
    assert ratios(BASE, other) == got  # the same seed: the same interval


def test_unpaired_or_single_rounds_have_no_interval() -> None:
    for a, b in ((BASE, BASE[:4]), ([[1.0]], [[2.0]])):
        got = ratios(a, b)
        assert all(math.isnan(v[1]) and math.isnan(v[2]) for v in got.values())
    assert ratios([[1.0]], [[2.0]])["mean"][0] == 2.0


def test_across_starts_is_the_geometric_mean_with_a_t_interval_over_the_starts() -> None:
    got = across_starts([1.0, 1.1, 0.95, 1.05])
    logs = np.log([1.0, 1.1, 0.95, 1.05])
    half = 3.182 * logs.std(ddof=1) / 2  # t(3 degrees of freedom) x the standard error
    assert got == [round(float(np.exp(x)), 4)
                   for x in (logs.mean(), logs.mean() - half, logs.mean() + half)]
    assert across_starts([1.2, 1.2, 1.2]) == [1.2, 1.2, 1.2]  # identical starts: degenerate
    one = across_starts([1.03])
    assert one[0] == 1.03 and math.isnan(one[1]) and math.isnan(one[2])
    assert all(math.isnan(v) for v in across_starts([]))
