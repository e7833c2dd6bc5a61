"""Wall time the connector spends inside each vLLM hook: its own cost per engine step.

Contract
--------
`time_hooks(obj, clock)` shadows, on the one connector instance ``obj``, the per-step hooks
vLLM calls on its side (`SCHEDULER_HOOKS` in the engine core's scheduler, `WORKER_HOOKS` in
the worker's ``execute_model``; ``clock.side``) with wrappers that add each call's wall
nanoseconds (``perf_counter_ns``, so a hook that waits counts) to ``clock``. A hook's time
is everything the connector does in it. What vLLM does around the hooks because a
connector is loaded (its output objects, the per-layer ``wait_for_layer_load`` /
``save_kv_layer`` calls, which the connector leaves empty) is not in it: the A/B bench
(`bench.step_cost`) puts the two side by side.

Timing is opt-in (``kvstage_time_hooks: true``): a wrapper is one more call per hook, and
each step makes its first calls with caches the forward has just cooled. Untimed, the
class's methods are called directly: nothing is wrapped, nothing is paid.

`HookClock` is also the connector's once-a-second tick: ``due()`` is True at most once per
``flush_s`` (default 1 s), and ``take()`` then hands out the hook totals as
``[name, seconds, calls]`` entries (name ``scheduler.<hook>`` or ``worker.<hook>``), so the
connector's stats are empty on most steps and vLLM ships nothing extra per step. The stats
carry them to ``/metrics`` as ``vllm:kvstage_hook_seconds_total{hook=...}`` and
``vllm:kvstage_hook_calls_total{hook=...}`` (`stats`): per hook, seconds over calls is its
cost per call, and the calls of ``scheduler.build_connector_meta`` /
``worker.get_transfer_results`` count engine steps.

No vLLM import; no thread: a clock is used by the one thread that calls its side's hooks.
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
    """Per-hook wall nanoseconds and calls of one side (``"scheduler"`` or ``"worker"``),
    and that side's once-per-``flush_s`` tick."""

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

    def due(self) -> bool:
        """True at most once per ``flush_s``: the time to hand out what was counted."""
        now = self.clock()
        if now - self._flushed < self.flush_ns:
            return False
        self._flushed = now
        return True

    def take(self) -> list[list[Any]] | None:
        """The hook totals since the last take as ``[side.hook, seconds, calls]`` (and
        reset), or None when no hook was timed."""
        if not self.calls:
            return None
        out = [[f"{self.side}.{h}", self.ns[h] / 1e9, n] for h, n in self.calls.items()]
        self.ns, self.calls = {}, {}
        return out


def _timed(hook: str, method: Callable[..., Any], clock: HookClock) -> Callable[..., Any]:
    add, now = clock.add, time.perf_counter_ns

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = now()
        try:
            return method(*args, **kwargs)
        finally:
            add(hook, now() - start)

    return timed


def time_hooks(obj: Any, clock: HookClock) -> None:
    """Time into ``clock`` every hook of ``clock.side`` that ``obj`` has (`SCHEDULER_HOOKS`
    or `WORKER_HOOKS`), on ``obj`` alone: its class is left as it is."""
    hooks = SCHEDULER_HOOKS if clock.side == "scheduler" else WORKER_HOOKS
    for hook in hooks:
        method = getattr(obj, hook, None)
        if callable(method):
            setattr(obj, hook, _timed(hook, method, clock))
