"""Fault fake for tests/system/vllm/test_vllm_checksum.py, loaded from outside kvstage.

A prefill engine started with this directory first on ``PYTHONPATH`` imports this module
at interpreter start (Python's ``sitecustomize``). Then a request whose
``kv_transfer_params`` carry ``"kvstage_test_corrupt": true`` gets one byte of its first
saved block flipped in the host buffer right after its digest is taken: the bytes the
decode READs no longer match what the prefill hands out. The scheduler and the worker
share one process (the test engines run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the
marked request ids pass through a module set, not through vLLM's metadata.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstage.integrations.vllm.checksums import WorkerChecksums
from kvstage.integrations.vllm.scheduler import KVStageConnectorScheduler

PARAM = "kvstage_test_corrupt"
_marked: set[str] = set()
_logger = logging.getLogger("vllm.kvstage.faults")
_alloc = KVStageConnectorScheduler.update_state_after_alloc
_after_save = WorkerChecksums.after_save


def _update_state_after_alloc(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    if (request.kv_transfer_params or {}).get(PARAM):
        _marked.add(request.request_id)
    return _alloc(self, request, *args, **kwargs)


def _corrupting_after_save(self: Any, final: Any) -> None:
    _after_save(self, final)
    for req_id in _marked & set(final):
        ids = sorted(self._saved.get(req_id, ()))
        if ids:
            _marked.discard(req_id)
            plane = self._views[0][0, ids[0]].view(torch.uint8).reshape(-1)
            plane[0] ^= 0xFF  # the bytes change after the digest
            _logger.warning("kvstage fault fake: flipped a byte of block %d of %s", ids[0],
                            req_id)


KVStageConnectorScheduler.update_state_after_alloc = _update_state_after_alloc  # type: ignore[method-assign]
WorkerChecksums.after_save = _corrupting_after_save  # type: ignore[method-assign]
