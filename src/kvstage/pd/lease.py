"""The lease decision, once: how long a prefill holds a request's blocks, and how long a
decode's READ of them may run.

Model: the prefill holds a request's saved blocks until a deadline on its own clock
(`deadline`: ``now + lease_s``, renewed on the same rule, never past ``hold_until``; held
until it `expired`), then frees them for other requests. A READ that runs past that moment
may copy another request's KV. A decode (the CLI's and the vLLM connector's, both
`kvstage.pd.decode`) asks with Acquire, which renews the hold (or is refused once the
lease ended) and answers ``remaining_s`` on the prefill's clock: its READ gets at most
`read_budget` seconds, then fails as a timeout. No clocks are compared across processes.
Pure functions, no state, no thread.
"""

from __future__ import annotations

__all__ = ["deadline", "expired", "read_budget"]


def deadline(now: float, lease_s: float, hold_until: float = float("inf")) -> float:
    """Prefill: when a hold taken (or renewed) at ``now`` ends."""
    return min(now + lease_s, hold_until)


def expired(until: float, now: float) -> bool:
    """Prefill: whether a hold that ends at ``until`` is over at ``now``."""
    return until <= now


def read_budget(read_timeout_s: float, left_s: float) -> float:
    """Decode that bounds its READ: the READ must end before the lease does."""
    return min(read_timeout_s, left_s)
