"""Shared fixtures, helpers and the central skips of the test suite.

Markers (declared in pyproject.toml) skip here, once, with a reason:
- ``gpu``: needs ``torch.cuda.is_available()``;
- ``nixl``: needs ``nixl_cu12`` importable.

Hypothesis profiles: ``ci`` (default: modest example counts, no deadline) and ``full``
(2000 examples); pick one with ``KVSTAGE_HYPOTHESIS_PROFILE=full``.

Helpers shared by test modules live in ``tests/helpers.py`` (``from tests.helpers import
...``), never in this file.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

import kvstage as ks

# One intra-op thread: on a small shared machine (2 cores, other jobs running) torch's
# OpenMP workers stall at barriers whenever a core is taken, and a 128 KiB block copy
# measured 600x slower (5 s for 640 copies instead of 8 ms). Bytes do not depend on it.
torch.set_num_threads(1)

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "full",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("KVSTAGE_HYPOTHESIS_PROFILE", "ci"))


def _nixl_available() -> bool:
    try:
        importlib.import_module("nixl_cu12")
    except Exception:  # not installed, or a broken install (missing UCX libs)
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_gpu = torch.cuda.is_available()
    has_nixl: bool | None = None  # probed lazily: importing NIXL is slow
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    skip_nixl = pytest.mark.skip(
        reason="needs NIXL: `pip install kvstage[nixl]` (nixl_cu12 could not be imported)"
    )
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if "nixl" in item.keywords:
            if has_nixl is None:
                has_nixl = _nixl_available()
            if not has_nixl:
                item.add_marker(skip_nixl)


# -- fixtures shared across folders -------------------------------------------------
@pytest.fixture
def engine() -> ks.CopyEngine:
    layout = ks.preset("gemma-3-1b", num_blocks=64, block_size=4)  # 7 groups, 4 tensors
    cache = ks.KVCache(layout)
    cache.fill_random(1)
    host = ks.HostBuffer(layout)
    eng = ks.CopyEngine(cache, host)
    eng.save_to_host([[1, 2], [3], [], [4], [5], [6], [7, 8, 9]])  # host is not all zeros
    cache.fill_random(2)
    return eng
