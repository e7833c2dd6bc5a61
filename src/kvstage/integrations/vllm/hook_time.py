"""Wall time the connector spends inside each vLLM hook: its own cost per engine step.

Contract
--------
`time_hooks(cls)` wraps the per-step hooks vLLM calls on a connector (`SCHEDULER_HOOKS` in
the engine core's scheduler, `WORKER_HOOKS` in the worker's ``execute_model``) so that
each call adds its wall nanoseconds (``perf_counter_ns``, so a hook that waits counts) to
the instance's `HookClock` (``self.kvstage_clock``; None: not timed). A hook's time is
everything the connector does in it, vLLM's NIXL code it inherits included. What vLLM does
around the hooks because a connector is loaded (its output objects, the per-layer
``wait_for_layer_load``/``save_kv_layer`` calls, which the NIXL connector leaves empty) is
not in it: the A/B bench (`bench.step_cost`) puts the two side by side.

`HookClock.take()` hands the totals out at most once per ``flush_s`` (default 1 s), as
``[name, seconds, calls]`` entries (name ``scheduler.<hook>`` or ``worker.<hook>``), so the
connector's stats are empty on most steps and vLLM ships nothing extra per step;
``take(force=True)`` hands them out now. The stats carry them to ``/metrics`` as
``vllm:kvstage_hook_seconds_total{hook=...}`` and ``vllm:kvstage_hook_calls_total{hook=...}``
(`stats`): per hook, seconds over calls is its cost per call, and the calls of
``scheduler.build_connector_meta`` / ``worker.get_transfer_results`` count engine steps.

Cost: two ``perf_counter_ns`` calls and two dict updates per hook call, about 18 hook
calls per step; ``kvstage_time_hooks: false`` turns it off. No vLLM import; no thread: a
clock is used by the one thread that calls its side's hooks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HOOK_KEY", "SCHEDULER_HOOKS", "WORKER_HOOKS", "HookClock", "time_hooks"]

#: the stats key of the entries (`stats.KVStageStats`): a list of [name, seconds, calls]
HOOK_KEY = "kvstage_hook_time"
#: hooks vLLM's scheduler calls on the connector (every step, or per request)
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "on_new_request", "update_connector_output", "request_finished",
    "request_finished_all_groups", "get_kv_connector_stats",
)
#: hooks vLLM's worker calls on the connector in every ``execute_model``
WORKER_HOOKS = (
    "bind_connector_metadata", "start_load_kv", "wait_for_save", "get_transfer_results",
    "get_block_ids_with_load_errors", "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events", "build_connector_worker_meta",
    "clear_connector_metadata",
)
FLUSH_S = 1.0


class HookClock:
    """Per-hook wall nanoseconds and calls of one side (``"scheduler"`` or ``"worker"``)."""

    def __init__(self, side: str, flush_s: float = FLUSH_S,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.side = side
        self.flush_ns = int(flush_s * 1e9)
        self.clock = clock
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._flushed = clock()

    def add(self, hook: str, ns: int) -> None:
        self.ns[hook] = self.ns.get(hook, 0) + ns
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def take(self, force: bool = False) -> list[list[Any]] | None:
        """The totals since the last take as ``[side.hook, seconds, calls]`` (and reset),
        or None when there are none or the last take was under ``flush_s`` ago."""
        now = self.clock()
        if not self.calls or (not force and now - self._flushed < self.flush_ns):
            return None
        out = [[f"{self.side}.{h}", self.ns[h] / 1e9, n] for h, n in self.calls.items()]
        self.ns, self.calls, self._flushed = {}, {}, now
        return out


def _timed(hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        clock: HookClock | None = self.kvstage_clock
        if clock is None:
            return fn(self, *args, **kwargs)
        start = time.perf_counter_ns()
        try:
            return fn(self, *args, **kwargs)
        finally:
            clock.add(hook, time.perf_counter_ns() - start)

    return timed


def time_hooks(cls: type) -> type:
    """``cls`` with every hook of `SCHEDULER_HOOKS` and `WORKER_HOOKS` it has timed into
    ``self.kvstage_clock`` (a class attribute None until an instance sets its own)."""
    for hook in dict.fromkeys(SCHEDULER_HOOKS + WORKER_HOOKS):
        fn = getattr(cls, hook, None)
        if fn is not None:
            setattr(cls, hook, _timed(hook, fn))
    if not hasattr(cls, "kvstage_clock"):
        cls.kvstage_clock = None  # type: ignore[attr-defined]
    return cls
