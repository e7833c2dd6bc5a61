"""Fault fake for tests/system/vllm/test_vllm_checksum.py, loaded from outside kvstage.

A prefill engine started with this directory first on ``PYTHONPATH`` imports this module
at interpreter start (Python's ``sitecustomize``). Then a request whose
``kv_transfer_params`` carry ``"kvstage_test_corrupt": true`` gets one byte of its first
saved block flipped in the host buffer right after its hold (when the prefill role takes
the digests): the bytes the decode READs no longer match what the prefill hands out. The
scheduler and the worker share one process (the test engines run with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the marked request ids pass through a module
set, not through vLLM's metadata.

Nothing is imported at interpreter start: the connector's modules are patched as vLLM
imports them (a finder on ``sys.meta_path`` wraps their loader), so the engine starts
exactly as it would without the fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

PARAM = "kvstage_test_corrupt"
_marked: set[str] = set()
_logger = logging.getLogger("vllm.kvstage.faults")


def _patch_scheduler(module: ModuleType) -> None:
    after_alloc = module.SchedulerSide.after_alloc

    def marking(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if (request.kv_transfer_params or {}).get(PARAM):
            _marked.add(request.request_id)
        return after_alloc(self, request, *args, **kwargs)

    module.SchedulerSide.after_alloc = marking


def _patch_worker(module: ModuleType) -> None:
    save = module.WorkerSide.save

    def corrupting(self: Any, meta: Any) -> None:
        save(self, meta)
        role = self.prefill
        for rid in _marked & set(meta.holds):
            ids = sorted(b for g in role._requests[rid].block_ids for b in g)
            if ids:
                _marked.discard(rid)
                plane = role.host.tensor_views[0][0, ids[0]].view(-1)
                plane.view(dtype=__import__("torch").uint8)[0] ^= 0xFF  # after the digest
                _logger.warning("kvstage fault fake: flipped a byte of block %d of %s",
                                ids[0], rid)

    module.WorkerSide.save = corrupting


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "kvstage.integrations.vllm.scheduler": _patch_scheduler,
    "kvstage.integrations.vllm.worker": _patch_worker,
}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Finder())
