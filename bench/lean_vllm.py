"""A prototype of an upstream vLLM change, measured here and not shipped: idle connector steps.

With any KV connector, vLLM 0.32.0 runs its connector machinery in every engine step: the
per-layer ``maybe_transfer_kv_layer`` wrapper around each attention call, and around the
forward the model runner's ``_get_kv_connector_output`` (bind, ``start_load_kv``,
``wait_for_save``, ``get_transfer_results``, the load errors, the stats, the events, the
worker meta, clear) whose ``KVConnectorOutput`` then travels to the scheduler. A connector
that does nothing still costs 2.7-4.6 % of a plain server's ITL here (BENCHMARKS "Over ten
starts"), more than kvstage's whole remaining share.

The change proposed: before the forward, vLLM asks the connector whether the step is idle
for it (``step_is_idle(metadata) -> bool``, with the step's metadata, before binding it;
the base class answers False, so every connector keeps today's behaviour). For an idle
step vLLM skips the per-layer wrapper's connector calls and the per-step hooks (bind
included), and the step carries no ``KVConnectorOutput`` (None: what a server without a
connector sends). The proposal and its figures: BENCHMARKS "Idle connector steps".

`apply` makes that change in the running vLLM by replacing two module attributes (the
wrapper's ``has_kv_transfer_group`` lookup and the mixin's ``_get_kv_connector_output``)
and leaves every connector without ``step_is_idle`` on vLLM's own path. Two connectors
apply it when built (vLLM builds one in each process that runs one, the scheduler's and
the worker's; the servers find them as ``"kv_connector_module_path": "bench.lean_vllm"``):
- `LeanNullConnector`: `bench.null_connector`'s connector with every step idle, what any
  connector would cost an instance with the change;
- `LeanKVStageConnector`: kvstage's, whose ``KVStageConnector.step_is_idle`` answers (its
  quiet steps, quiet.py).
`bench.step_cost --arrangements lean` serves the first beside a plain server and the
unchanged null connector; ``lean-kvstage`` the second beside plain and unchanged kvstage.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.distributed import kv_transfer
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import kv_transfer_utils
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from bench.null_connector import NullConnector
from kvstage.integrations.vllm.connector import KVStageConnector

__all__ = ["LeanKVStageConnector", "LeanNullConnector", "apply", "applied"]

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


class LeanKVStageConnector(KVStageConnector):
    """`KVStageConnector` on a vLLM with the change: its own ``step_is_idle`` (its quiet
    steps, quiet.py) answers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        apply()
