"""Ratios of two servers' latencies in an interleaved A/B, with paired bootstrap intervals.

On this shared 2-core VM one request's mean inter-token gap moves between 2.8 and 5-7 ms
from one request to the next (the same server, seconds apart; a server's api_server,
engine core and busy-looping worker share one core), so a ratio over a few tens of
rounds is only known to several percent, and two identical servers differ by that much.
Each ratio therefore comes with its interval, and for several statistics: ``mean`` (what
a client sees on average), ``p10`` (the quick requests: the step as it runs when little
else gets in the way), ``p50`` and ``p90`` (whatever a server, or the box, adds on top,
such as a thread of its own waking up).

`ratios(base, other)`: per statistic of `STATS`, ``[other's / base's, low, high]``, the
interval the 95 % of ``resamples`` bootstrap resamples of the ROUNDS give (paired: round
``r`` of both servers is resampled together, as their requests ran seconds apart under the
same load; a resample pools the samples of its rounds). ``base`` and ``other``: per round,
the samples of that round (a request's TTFT, its mean gap, or its gaps).

`across_starts(values)`: one ratio measured on several fresh starts of the servers,
``[geometric mean, low, high]`` with a 95 % Student-t interval over the starts (on the
logs). A start's own interval leaves out its processes' luck (two identical servers
started afresh differ by several percent, start to start); this one has it in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["STATS", "across_starts", "ratios"]


def _percentile(q: float) -> Callable[[np.ndarray], float]:
    return lambda x: float(np.percentile(x, q))


#: the statistics a ratio is given for
STATS: dict[str, Callable[[np.ndarray], float]] = {
    "mean": lambda x: float(np.mean(x)),
    "p10": _percentile(10),
    "p50": _percentile(50),
    "p90": _percentile(90),
}


def ratios(base: Sequence[Sequence[float]], other: Sequence[Sequence[float]],
           resamples: int = 1000, seed: int = 0) -> dict[str, list[float]]:
    """See the module doc. Rounds of unequal count, or fewer than 2: NaN intervals."""
    a = [np.asarray(r, dtype=float) for r in base]
    b = [np.asarray(r, dtype=float) for r in other]
    out = {}
    for name, stat in STATS.items():
        whole = stat(np.concatenate(b)) / stat(np.concatenate(a)) if a and b else float("nan")
        out[name] = [round(whole, 4), float("nan"), float("nan")]
    if len(a) != len(b) or len(a) < 2:
        return out
    picks = np.random.default_rng(seed).integers(0, len(a), size=(resamples, len(a)))
    draws: dict[str, list[float]] = {name: [] for name in STATS}
    for pick in picks:
        pa = np.concatenate([a[i] for i in pick])
        pb = np.concatenate([b[i] for i in pick])
        for name, stat in STATS.items():
            draws[name].append(stat(pb) / stat(pa))
    for name, values in draws.items():
        low, high = np.percentile(values, [2.5, 97.5])
        out[name][1:] = [round(float(low), 4), round(float(high), 4)]
    return out


#: Student t's 97.5th percentile by degrees of freedom (1-30; beyond, 30's is within 2 %)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def across_starts(values: Sequence[float]) -> list[float]:
    """See the module doc. Fewer than 2 starts: a NaN interval."""
    logs = np.log(np.asarray(values, dtype=float))
    if not len(logs):
        return [float("nan")] * 3
    centre = float(np.mean(logs))
    if len(logs) < 2:
        return [round(float(np.exp(centre)), 4), float("nan"), float("nan")]
    half = _T975[min(len(logs) - 1, len(_T975)) - 1] * float(np.std(logs, ddof=1)) / np.sqrt(
        len(logs))
    return [round(float(np.exp(x)), 4) for x in (centre, centre - half, centre + half)]
