"""Fault fake for tests/system/vllm/test_vllm_checksum.py, loaded from outside kvstage.

A prefill engine started with this directory first on ``PYTHONPATH`` imports this module
at interpreter start (Python's ``sitecustomize``). Then a request whose
``kv_transfer_params`` carry ``"kvstage_test_corrupt": true`` gets one byte of its first
saved block flipped in the host buffer right after its hold (when the prefill role takes
the digests): the bytes the decode READs no longer match what the prefill hands out. The
scheduler and the worker share one process (the test engines run with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the marked request ids pass through a module
set, not through vLLM's metadata.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstage.integrations.vllm.native.scheduler import SchedulerSide
from kvstage.integrations.vllm.native.worker import WorkerSide

PARAM = "kvstage_test_corrupt"
_marked: set[str] = set()
_logger = logging.getLogger("vllm.kvstage.faults")
_after_alloc = SchedulerSide.after_alloc
_save = WorkerSide.save


def _marking_after_alloc(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    if (request.kv_transfer_params or {}).get(PARAM):
        _marked.add(request.request_id)
    return _after_alloc(self, request, *args, **kwargs)


def _corrupting_save(self: Any, meta: Any) -> None:
    _save(self, meta)
    role = self.prefill
    for rid in _marked & set(meta.holds):
        ids = sorted(b for g in role._requests[rid].block_ids for b in g)
        if ids:
            _marked.discard(rid)
            plane = role.host.tensor_views[0][0, ids[0]].view(torch.uint8).reshape(-1)
            plane[0] ^= 0xFF  # the bytes change after the digest
            _logger.warning("kvstage fault fake: flipped a byte of block %d of %s", ids[0], rid)


SchedulerSide.after_alloc = _marking_after_alloc  # type: ignore[method-assign]
WorkerSide.save = _corrupting_save  # type: ignore[method-assign]
