"""CopyEngine: device <-> host copies of a request's KV blocks, three strategies.

- ``per_group``: vLLM before PR #54483: one copy call per group, each applying that
  group's ids to every layer name with vLLM's CUDA-platform ops (advanced-index gather,
  ``.to(device)``, advanced-index assignment). G x L x k ops per request.
- ``coalesced``: vLLM after PR #54483: the groups' ids concatenated, one call. L x k.
- ``fused`` (default): kvstage. Every physical tensor at once through the canonical
  ``[T, P, NB, E]`` view: one slice copy per contiguous run (``direct``), or, on CUDA,
  gathers into a staging buffer bounded by ``max_temp_bytes`` with one DMA per run
  (``staged``). Op count depends on runs only, never on groups or layers; CUDA copies
  are non-blocking from pinned memory with one synchronisation per request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvstage.blocks import GroupedBlockIds
from kvstage.host_buffer import HostBuffer, KVCache
from kvstage.layout import KVLayout
from kvstage.plan import DEFAULT_MAX_TEMP_BYTES, CopyPlan, plan_copy


class Direction(enum.Enum):
    D2H = "d2h"
    H2D = "h2d"


class Strategy(enum.Enum):
    PER_GROUP = "per_group"
    COALESCED = "coalesced"
    FUSED = "fused"


FusedMode = Literal["auto", "direct", "staged"]


@dataclass(frozen=True)
class CopyStats:
    direction: Direction
    strategy: Strategy
    blocks: int
    runs: int
    chunks: int
    nbytes: int


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


def _staged_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype.itemsize == 1 else dtype


def _difference(cache: KVLayout, host: KVLayout) -> str:
    """Which field differs, in check_compatible's words (same-named layouts, e.g. one
    preset at two pool sizes or dtypes, would otherwise read "gemma-3-1b vs gemma-3-1b")."""
    try:
        cache.check_compatible(host)
    except ValueError as exc:
        return " (" + str(exc).replace(" here", " (cache)").replace(" remote", " (host)") + ")"
    return " (they differ only in name)"


class CopyEngine:
    """Copies a request's blocks between a device `KVCache` and its `HostBuffer`."""

    def __init__(
        self,
        cache: KVCache,
        host: HostBuffer,
        *,
        strategy: Strategy | str = Strategy.FUSED,
        max_temp_bytes: int = DEFAULT_MAX_TEMP_BYTES,
        mode: FusedMode = "auto",
    ) -> None:
        if cache.layout != host.layout:
            raise ValueError(
                "device cache and host buffer were built for different layouts: "
                f"{cache.layout.name or cache.layout} vs {host.layout.name or host.layout}"
                f"{_difference(cache.layout, host.layout)}; build both from one KVLayout"
            )
        try:
            self.strategy = Strategy(strategy)
        except ValueError:
            raise ValueError(
                f"unknown strategy {strategy!r}; choose one of {[s.value for s in Strategy]}"
            ) from None
        if mode not in ("auto", "direct", "staged"):
            raise ValueError(f"mode must be 'auto', 'direct' or 'staged', got {mode!r}")
        if not isinstance(max_temp_bytes, int) or max_temp_bytes <= 0:
            raise ValueError(f"max_temp_bytes must be a positive int, got {max_temp_bytes!r}")
        self.cache = cache
        self.host = host
        self.layout = cache.layout
        self.max_temp_bytes = max_temp_bytes
        self.is_cuda = cache.device.type == "cuda"
        if self.is_cuda and not host.pinned:
            raise ValueError("a CUDA cache needs a pinned host buffer: HostBuffer.for_device()")
        self.mode = ("staged" if self.is_cuda else "direct") if mode == "auto" else mode
        # per-layer views for the vLLM baselines (aliasing views, as vLLM's dicts hold)
        self._device_layers = cache.layer_caches()
        self._host_layers = host.layer_views()

    # -- public API -------------------------------------------------------------------
    def save_to_host(self, ids: GroupedBlockIds | list[list[int]]) -> CopyStats:
        """d2h: device blocks -> host buffer (prefill side)."""
        return self.copy(ids, Direction.D2H)

    def load_to_device(self, ids: GroupedBlockIds | list[list[int]]) -> CopyStats:
        """h2d: host buffer -> device blocks (decode side)."""
        return self.copy(ids, Direction.H2D)

    def plan(self, ids: GroupedBlockIds | list[list[int]]) -> CopyPlan:
        return plan_copy(self.layout, self._ids(ids), max_temp_bytes=self.max_temp_bytes)

    def copy(self, ids: GroupedBlockIds | list[list[int]], direction: Direction) -> CopyStats:
        grouped = self._ids(ids)  # validates everything before a byte moves
        direction = Direction(direction)
        if self.strategy is Strategy.FUSED:
            plan = plan_copy(self.layout, grouped, max_temp_bytes=self.max_temp_bytes)
            if not plan.is_empty:
                if self.mode == "direct":
                    self._fused_direct(plan, direction)
                else:
                    self._fused_staged(plan, direction)
                self._sync()
            return CopyStats(
                direction, self.strategy, plan.num_blocks, plan.num_runs,
                plan.num_chunks if self.mode == "staged" else 0, plan.nbytes,
            )
        return self._vllm(grouped, direction)

    # -- baselines ----------------------------------------------------------------------
    def _vllm(self, ids: GroupedBlockIds, direction: Direction) -> CopyStats:
        if direction is Direction.D2H:
            src, dst = self._device_layers, self._host_layers
        else:
            src, dst = self._host_layers, self._device_layers
        calls = (
            [g.tolist() for g in map(ids.group, range(ids.num_groups))]
            if self.strategy is Strategy.PER_GROUP
            else [ids.flat.tolist()]
        )
        block_dim = self.layout.cache_layout.block_dim
        nbytes = 0
        for group_ids in calls:
            vllm_copy_kv_blocks(
                src, dst, group_ids, group_ids, direction.value, block_dim=block_dim
            )
            nbytes += len(group_ids) * len(src) * self.layout.page_size_bytes
        return CopyStats(direction, self.strategy, len(ids), 0, 0, nbytes)

    # -- fused ----------------------------------------------------------------------------
    def _fused_direct(self, plan: CopyPlan, direction: Direction) -> None:
        """One strided slice copy per run over every tensor and plane at once."""
        dev, host = self.cache.canonical, self.host.canonical
        src, dst = (dev, host) if direction is Direction.D2H else (host, dev)
        for s, d, n in plan.runs.tolist():
            dst[:, :, d : d + n].copy_(src[:, :, s : s + n], non_blocking=self.is_cuda)

    def _fused_staged(self, plan: CopyPlan, direction: Direction) -> None:
        """Per chunk: one gather (d2h) or scatter (h2d) kernel on the device between the
        cache and a contiguous staging buffer, and one contiguous DMA per run piece
        between staging and the host. Staging holds at most ``plan.chunk_blocks`` blocks.
        """
        t, p, _, e = self.layout.canonical_shape
        rows = min(plan.chunk_blocks, plan.num_blocks)
        block_major = self.host.block_major
        # staging order matches the host so every DMA is contiguous on both ends
        shape = (rows, t, p, e) if block_major else (t, p, rows, e)
        # 1-byte dtypes move as uint8 (same element count, so no cost): torch's CPU
        # index_select/index_copy_ have no float8 kernels ("index_copy_cpu" not
        # implemented for 'Float8_e4m3fn'); _host_run returns the matching byte view
        dtype = _staged_dtype(self.layout.torch_dtype)
        staging = torch.empty(shape, dtype=dtype, device=self.cache.device)
        slab = self.cache.slab.view(dtype)
        dev_blocks = slab.permute(2, 0, 1, 3) if block_major else slab
        bdim = 0 if block_major else 2
        ids_all = plan.block_ids
        for k, (first, end) in enumerate(plan.chunks.tolist()):
            lo = k * plan.chunk_blocks
            hi = min(lo + plan.chunk_blocks, plan.num_blocks)
            idx = self._index(ids_all[lo:hi])
            view = staging.narrow(bdim, 0, hi - lo)
            pieces = plan.pieces[first:end].tolist()
            if direction is Direction.D2H:
                torch.index_select(dev_blocks, bdim, idx, out=view)
                for s, _d, n, off in pieces:
                    self._dma(self._host_run(s, n), view.narrow(bdim, off, n))
            else:
                for s, _d, n, off in pieces:
                    self._dma(view.narrow(bdim, off, n), self._host_run(s, n))
                dev_blocks.index_copy_(bdim, idx, view)

    def _host_run(self, start: int, n: int) -> torch.Tensor:
        storage = self.host.storage.view(_staged_dtype(self.host.storage.dtype))
        if self.host.block_major:
            return storage[start : start + n]
        return storage[:, :, start : start + n]

    def _dma(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.host.block_major or not self.is_cuda:
            dst.copy_(src, non_blocking=self.is_cuda)
            return
        # mirror host on CUDA: one contiguous copy per (tensor, plane)
        for ti in range(dst.shape[0]):
            for pi in range(dst.shape[1]):
                dst[ti, pi].copy_(src[ti, pi], non_blocking=True)

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(np.ascontiguousarray(ids))
        if self.is_cuda:
            idx = idx.pin_memory().to(self.cache.device, non_blocking=True)
        return idx

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.current_stream(self.cache.device).synchronize()

    def _ids(self, ids: GroupedBlockIds | list[list[int]]) -> GroupedBlockIds:
        if isinstance(ids, GroupedBlockIds):
            if ids.num_blocks != self.layout.num_blocks or ids.num_groups != self.layout.num_groups:
                raise ValueError(
                    f"ids validated for {ids.num_groups} groups x {ids.num_blocks} blocks; "
                    f"this engine's layout has {self.layout.num_groups} x {self.layout.num_blocks}"
                )
            return ids
        return GroupedBlockIds(ids, self.layout)

