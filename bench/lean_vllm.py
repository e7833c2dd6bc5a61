"""A prototype of a vLLM change, measured here and not shipped: idle connector steps.

With any KV connector, vLLM 0.32.0 runs its connector machinery in every engine step: the
per-layer ``maybe_transfer_kv_layer`` wrapper around each attention call, and around the
forward the model runner's ``_get_kv_connector_output`` (bind, ``start_load_kv``,
``wait_for_save``, ``get_transfer_results``, the load errors, the stats, the events, the
worker meta, clear) whose ``KVConnectorOutput`` then travels to the scheduler. A connector
that does nothing costs 2.7 % [1.7, 3.8] of a plain server's ITL on the tiny Llama over 50
starts (BENCHMARKS "What does the connector cost against plain vLLM?"), more than
kvstage's whole remaining share.

The change tried: before the forward, vLLM asks the connector whether the step is idle
for it (``step_is_idle(metadata) -> bool``, with the step's metadata, before binding it;
the base class answers False, so every connector keeps today's behaviour). For an idle
step vLLM skips the per-layer wrapper's connector calls and the per-step hooks (bind
included), and the step carries no ``KVConnectorOutput`` (None: what a server without a
connector sends). Measured over 10 starts each, it buys nothing that a run resolves: ITL
0.993x [0.977, 1.008] for the null connector, 1.015x [0.984, 1.047] for kvstage (BENCHMARKS
"What does the connector cost against plain vLLM?"). Those two pieces of machinery are
not where a connector's cost is, so the change is not proposed upstream; this module
keeps the experiment repeatable.

`apply` makes that change in the running vLLM by replacing two module attributes (the
wrapper's ``has_kv_transfer_group`` lookup and the mixin's ``_get_kv_connector_output``)
and leaves every connector without ``step_is_idle`` on vLLM's own path. Two connectors
apply it when built (vLLM builds one in each process that runs one, the scheduler's and
the worker's; the servers find them as ``"kv_connector_module_path": "bench.lean_vllm"``):
- `LeanNullConnector`: `bench.null_connector`'s connector with every step idle, what any
  connector would cost an instance with the change;
- `LeanKVStageConnector`: kvstage's, whose quiet steps (quiet.py) with no checksum digests
  to hand over are the idle ones.
`bench.step_cost --arrangements lean` serves the first beside a plain server and the
unchanged null connector; ``lean-kvstage`` the second beside plain and unchanged kvstage.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm.distributed import kv_transfer
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import kv_transfer_utils
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from bench.null_connector import NullConnector
from kvstage.integrations.vllm.connector import KVStageConnector

__all__ = ["LeanKVStageConnector", "LeanNullConnector", "apply", "applied", "idle_worker_step",
           "once_per_step"]

logger = init_logger("vllm.bench.lean_vllm")  # under "vllm": its log handler prints it
_ORIGINAL = KVConnectorModelRunnerMixin._get_kv_connector_output
_IDLE = threading.local()  # .step: this thread's current step is idle for the connector


def _connector_active() -> bool:
    """The per-layer wrapper's test: a connector exists and this step is not idle for it."""
    return kv_transfer.has_kv_transfer_group() and not getattr(_IDLE, "step", False)


@contextmanager
def _output(scheduler_output: Any, defer_finalize: bool = False) -> Iterator[Any]:
    """vLLM's ``_get_kv_connector_output``, unless the connector says the step is idle:
    then no hook runs and the step's connector output is None."""
    connector = kv_transfer.get_kv_transfer_group()
    idle = getattr(connector, "step_is_idle", None)
    if idle is None or not idle(scheduler_output.kv_connector_metadata):
        with _ORIGINAL(scheduler_output, defer_finalize=defer_finalize) as output:
            yield output
        return
    if not _IDLE.__dict__.get("said"):  # in the server's log: the change is in effect
        _IDLE.said = True
        logger.info("bench.lean_vllm: idle connector steps in effect (pid %d)", os.getpid())
    _IDLE.step = True
    try:
        yield None
    finally:
        _IDLE.step = False


def apply() -> None:
    """Make the change in this process (idempotent)."""
    kv_transfer_utils.has_kv_transfer_group = _connector_active
    KVConnectorModelRunnerMixin._get_kv_connector_output = staticmethod(_output)


def applied() -> bool:
    """Whether `apply` ran in this process."""
    return kv_transfer_utils.has_kv_transfer_group is _connector_active


class LeanNullConnector(NullConnector):
    """`NullConnector` with every step idle (the change above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        apply()

    def step_is_idle(self, metadata: Any) -> bool:
        return True


def once_per_step(begin: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """``QuietSteps.begin`` deciding once per metadata object: ``step_is_idle`` asks it
    first, then (on a step that is not idle) ``start_load_kv`` with the same metadata, and
    the step gets one decision (vLLM hands each step a new metadata object)."""
    last: list[Any] = [None, False]  # the metadata decided last, its answer

    def decide(metadata: Any) -> bool:
        if metadata is not last[0]:
            last[0], last[1] = metadata, begin(metadata)
        return bool(last[1])

    return decide


def idle_worker_step(worker: Any, metadata: Any) -> bool:
    """kvstage's answer to ``step_is_idle``: a quiet step (quiet.py) with no checksum
    digests waiting for the scheduler (``build_connector_worker_meta``)."""
    return (not worker.kvstage_quiet.begin(metadata)
            and not worker._kvstage_checksums._saved)


class LeanKVStageConnector(KVStageConnector):
    """`KVStageConnector` on a vLLM with the change: its worker's quiet steps are idle
    ones. The connector's half lives here, not in the product, because the change did
    not pay (BENCHMARKS "What does the connector cost against plain vLLM?")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        apply()
        worker = self.connector_worker
        if worker is not None:
            quiet = worker.kvstage_quiet
            quiet.begin = once_per_step(quiet.begin)  # type: ignore[method-assign,assignment]

    def step_is_idle(self, metadata: Any) -> bool:
        worker = self.connector_worker
        return worker is not None and idle_worker_step(worker, metadata)
