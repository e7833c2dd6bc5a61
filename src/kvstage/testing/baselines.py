"""vLLM's host-path copy ops, faithfully, as the baselines the benches and tests compare to.

- ``per_group``: vLLM before PR #54483: one copy call per group, each applying that
  group's ids to every layer name with vLLM's CUDA-platform ops (advanced-index gather,
  ``.to(device)``, advanced-index assignment). G x L x k ops per request.
- ``coalesced``: vLLM after PR #54483: the groups' ids concatenated, one call. L x k.
- ``fused``: kvstage's `CopyEngine` (the product path).

Not part of the product: `kvstage.engine` never imports this module.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from kvstage.blocks import GroupedBlockIds
from kvstage.cache import HostBuffer, KVCache
from kvstage.engine import CopyEngine, CopyStats, Direction


class Strategy(enum.Enum):
    PER_GROUP = "per_group"
    COALESCED = "coalesced"
    FUSED = "fused"


def vllm_copy_kv_blocks(
    src_caches: dict[str, torch.Tensor],
    dst_caches: dict[str, torch.Tensor],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    direction: str,
    *,
    block_dim: int = 0,
) -> None:
    """vLLM's ``copy_kv_blocks`` with the CUDA platform's per-layer ops, as users run it.

    Faithful on purpose (the baseline must not be weakened): silent early returns on
    empty input, one index tensor per side, then per layer name ``dst[idx] =
    src[idx].to(dst.device)`` (dim 1 for K/V-split layouts).
    """
    if not src_caches or not dst_caches or not src_block_ids or not dst_block_ids:
        return
    if len(src_block_ids) != len(dst_block_ids):
        return
    src_device = next(iter(src_caches.values())).device
    dst_device = next(iter(dst_caches.values())).device
    src_idx = torch.tensor(src_block_ids, device=src_device, dtype=torch.int64)
    dst_idx = torch.tensor(dst_block_ids, device=dst_device, dtype=torch.int64)
    for name, src in src_caches.items():
        dst = dst_caches[name]
        if block_dim == 0:
            dst[dst_idx] = src[src_idx].to(dst.device)
        else:
            dst[:, dst_idx] = src[:, src_idx].to(dst.device)
    _ = direction  # both directions use the same ops; the platform picks the device side


class BaselineEngine:
    """vLLM's per-group or coalesced host path over a `KVCache` and `HostBuffer`, with
    `CopyEngine`'s ``save_to_host`` / ``load_to_device`` / ``copy`` API."""

    def __init__(self, cache: KVCache, host: HostBuffer, strategy: Strategy) -> None:
        if strategy is Strategy.FUSED:
            raise ValueError("the fused strategy is CopyEngine; use make_engine")
        # CopyEngine validates the pair (layouts, pinning) and, per call, the ids
        self._checker = CopyEngine(cache, host)
        self.cache, self.host, self.strategy = cache, host, strategy
        self.layout = cache.layout
        # per-layer views, aliasing across groups, as vLLM's dicts hold them
        self._device_layers = cache.layer_caches()
        self._host_layers = host.layer_views()

    def save_to_host(self, ids: GroupedBlockIds | list[list[int]]) -> CopyStats:
        return self.copy(ids, Direction.D2H)

    def load_to_device(self, ids: GroupedBlockIds | list[list[int]]) -> CopyStats:
        return self.copy(ids, Direction.H2D)

    def copy(self, ids: GroupedBlockIds | list[list[int]], direction: Direction) -> CopyStats:
        grouped = self._checker._ids(ids)
        direction = Direction(direction)
        if direction is Direction.D2H:
            src, dst = self._device_layers, self._host_layers
        else:
            src, dst = self._host_layers, self._device_layers
        calls = (
            [g.tolist() for g in map(grouped.group, range(grouped.num_groups))]
            if self.strategy is Strategy.PER_GROUP
            else [grouped.flat.tolist()]
        )
        block_dim = self.layout.cache_layout.block_dim
        nbytes = 0
        for group_ids in calls:
            vllm_copy_kv_blocks(
                src, dst, group_ids, group_ids, direction.value, block_dim=block_dim
            )
            nbytes += len(group_ids) * len(src) * self.layout.page_size_bytes
        return CopyStats(direction, len(grouped), 0, 0, nbytes)


def make_engine(
    cache: KVCache, host: HostBuffer, strategy: Strategy | str = Strategy.FUSED, **options: Any
) -> CopyEngine | BaselineEngine:
    """`CopyEngine` for ``fused`` (with ``options``), `BaselineEngine` otherwise."""
    try:
        strategy = Strategy(strategy)
    except ValueError:
        raise ValueError(
            f"unknown strategy {strategy!r}; choose one of {[s.value for s in Strategy]}"
        ) from None
    if strategy is Strategy.FUSED:
        return CopyEngine(cache, host, **options)
    return BaselineEngine(cache, host, strategy)
