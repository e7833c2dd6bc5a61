"""The lease decision, once: how long a prefill holds a request's blocks, and whether a
decode may still READ them.

Model: the prefill holds a request's saved blocks until a deadline on its own clock
(`deadline`: ``now + lease_s``, renewed on the same rule, never past ``hold_until``; held
until it `expired`), then frees them for other requests. A READ that runs past that moment
may copy another request's KV. A decode therefore decides on the time left of the lease on
its own clock, `time_left`, with either input:

- the CLI's decode (`kvstage.pd.decode`) asks with Acquire, which renews the hold and
  answers ``remaining_s`` (``clock_offset`` 0, ``expires = remaining_s``, ``now`` 0): its
  READ gets at most `read_budget` seconds, then fails as a timeout;
- vLLM's decode (`KVStageConnector`, `kvstage.integrations.vllm.lease`) cannot bound a READ
  it hands to vLLM: it gets the prefill's deadline in the prefill's ``perf_counter``
  seconds and vLLM's handshake clock offset, and does not start a READ whose lease ends
  within a margin (`read_refusal`).

No wall clocks are compared: only each process's monotonic clock, and an offset measured
between the two. Pure functions, no state, no thread.
"""

from __future__ import annotations

__all__ = ["deadline", "expired", "read_budget", "read_refusal", "time_left"]


def deadline(now: float, lease_s: float, hold_until: float = float("inf")) -> float:
    """Prefill: when a hold taken (or renewed) at ``now`` ends."""
    return min(now + lease_s, hold_until)


def expired(until: float, now: float) -> bool:
    """Prefill: whether a hold that ends at ``until`` is over at ``now``."""
    return until <= now


def time_left(expires: float, clock_offset: float, now: float) -> float:
    """Decode: seconds of lease left at local time ``now``; ``expires`` is on the prefill's
    clock, ``clock_offset`` = prefill clock - local clock."""
    return expires - clock_offset - now


def read_budget(read_timeout_s: float, left_s: float) -> float:
    """Decode that bounds its READ: the READ must end before the lease does."""
    return min(read_timeout_s, left_s)


def read_refusal(left_s: float, margin_s: float, *, margin_name: str) -> str | None:
    """Decode that cannot bound its READ: why it must not start (a sentence naming the
    margin's setting ``margin_name``), or None when more than ``margin_s`` is left."""
    if left_s > margin_s:
        return None
    when = f"ended {-left_s:.2f} s ago" if left_s <= 0 else f"ends in {left_s:.2f} s"
    return (f"the prefill's lease on its blocks {when}, within the {margin_s:g} s margin "
            f"({margin_name}): the blocks may hold another request's KV by the time they "
            "are read")
