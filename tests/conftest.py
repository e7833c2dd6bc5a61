"""Shared fixtures, helpers and the central skips of the test suite.

Markers (declared in pyproject.toml) skip here, once, with a reason:
- ``gpu``: needs ``torch.cuda.is_available()``;
- ``nixl``: needs ``nixl_cu12`` importable.

Hypothesis profiles: ``ci`` (default: modest example counts, no deadline) and ``full``
(2000 examples); pick one with ``KVSTAGE_HYPOTHESIS_PROFILE=full``.

The byte helpers below are the tests' reference semantics; test modules import them with
``from conftest import ...`` (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, settings

from kvstage import NULL_BLOCK, HostBuffer, KVCache

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


# -- byte helpers ---------------------------------------------------------------------


def as_bytes(canonical: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 copy ``[T, P, NB, E * itemsize]`` of a canonical view."""
    return canonical.detach().to("cpu").contiguous().view(torch.uint8).clone()


def fill_host_random(host: HostBuffer, seed: int) -> None:
    """Random finite bytes in a host buffer (the same recipe as KVCache.fill_random)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8, generator=gen)
    if host.layout.torch_dtype.is_floating_point:
        raw.view(-1, host.storage.element_size())[:, -1] &= 0x3F
    host.storage.view(-1).view(torch.uint8).copy_(raw)


def make_pair(
    cache: KVCache, host: HostBuffer, seed: int
) -> tuple[KVCache, HostBuffer]:
    """Fill both sides with different random bytes (never zeros: a skipped block or a
    block copied to the wrong place cannot compare equal by accident)."""
    cache.fill_random(seed)
    fill_host_random(host, seed + 1)
    return cache, host


def naive_copy(src: torch.Tensor, dst: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """The reference: a copy of ``dst`` (canonical bytes) where, for every physical
    tensor and every non-null id, one block at a time is copied from ``src``."""
    out = dst.clone()
    for t in range(src.shape[0]):
        for b in ids:
            if b != NULL_BLOCK:
                out[t, :, b] = src[t, :, b]
    return out


def check_invariants(
    *,
    src_before: torch.Tensor,
    src_after: torch.Tensor,
    dst_before: torch.Tensor,
    dst_after: torch.Tensor,
    ids: Sequence[int],
    null_may_change: bool,
) -> None:
    """The three kv_offload invariants, on canonical bytes ``[T, P, NB, E]``.

    ``null_may_change``: the vLLM baselines copy block 0 when it appears in the ids
    (vLLM does: harmless waste), so block 0 is excluded from the untouched check for them;
    fused must never touch it.
    """
    assert torch.equal(src_after, src_before), "the source changed during the copy"
    mapped = sorted({int(b) for b in ids} - {NULL_BLOCK})
    if mapped:
        idx = torch.tensor(mapped)
        assert torch.equal(dst_after[:, :, idx], src_before[:, :, idx]), (
            "a mapped destination block differs from its source"
        )
    keep = [b for b in range(dst_before.shape[2]) if b not in set(mapped)]
    if null_may_change and NULL_BLOCK in {int(b) for b in ids}:
        keep.remove(NULL_BLOCK)
    idx = torch.tensor(keep, dtype=torch.int64)
    assert torch.equal(dst_after[:, :, idx], dst_before[:, :, idx]), (
        "an unmapped destination block was written"
    )
    expected = naive_copy(src_before, dst_before, ids)
    if null_may_change:
        expected[:, :, NULL_BLOCK] = dst_after[:, :, NULL_BLOCK]
    assert torch.equal(dst_after, expected), "destination differs from the naive reference"
