"""CopyEngine: a request's KV blocks between a device `KVCache` and its `HostBuffer`.

The product path only (vLLM's per-group and coalesced ops, the baselines, live in
`kvstage.testing.baselines`). Every physical tensor at once: one slice copy per
contiguous run of blocks (``direct``), over the whole ``[T, P, NB, E]`` slab when the
cache is one (kvstage's own, or an engine's evenly spaced backing buffer), else one per
run per physical tensor. On CUDA, ``staged``: gathers into a staging buffer bounded by
``max_temp_bytes`` with one DMA per run. Op count depends on runs (and tensors when
they are separate allocations), never on groups or layers. CUDA copies are
non-blocking from pinned memory with one synchronisation per request.

Per request, the direct path does: validation of the ids (`GroupedBlockIds`; skipped per
id with ``trusted=True`` for ids the engine's own allocator produced), planning
(`plan_copy`), then per run two views (``narrow``) and one ``copy_``, nothing else. The
views of the cache and the host buffer it slices are built once, at construction.

Thread rules: an engine is not thread-safe; one thread per engine (the P/D roles each
own one).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvstage.blocks import GroupedBlockIds
from kvstage.cache import HostBuffer, KVCache
from kvstage.errors import LayoutMismatch
from kvstage.layout import KVLayout
from kvstage.plan import DEFAULT_MAX_TEMP_BYTES, CopyPlan, plan_copy


class Direction(enum.Enum):
    D2H = "d2h"
    H2D = "h2d"


FusedMode = Literal["auto", "direct", "staged"]


@dataclass(frozen=True)
class CopyStats:
    direction: Direction
    blocks: int
    runs: int
    chunks: int
    nbytes: int
    ops: int = 0  # copy calls (direct: one per run per pair; staged: kernels and DMAs)


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
        max_temp_bytes: int = DEFAULT_MAX_TEMP_BYTES,
        mode: FusedMode = "auto",
    ) -> None:
        if cache.layout != host.layout:
            raise LayoutMismatch(
                "device cache and host buffer were built for different layouts: "
                f"{cache.layout.name or cache.layout} vs {host.layout.name or host.layout}"
                f"{_difference(cache.layout, host.layout)}; build both from one KVLayout"
            )
        if mode not in ("auto", "direct", "staged"):
            raise ValueError(f"mode must be 'auto', 'direct' or 'staged', got {mode!r}")
        if (
            not isinstance(max_temp_bytes, int) or isinstance(max_temp_bytes, bool)
            or max_temp_bytes <= 0
        ):
            raise ValueError(f"max_temp_bytes must be a positive int, got {max_temp_bytes!r}")
        self.cache = cache
        self.host = host
        self.layout = cache.layout
        self.max_temp_bytes = max_temp_bytes
        self.is_cuda = cache.device.type == "cuda"
        if self.is_cuda and not host.pinned:
            raise ValueError("a CUDA cache needs a pinned host buffer: HostBuffer.for_device()")
        # staged copies address the host as one [T, P, NB, E] storage; a wrapped host
        # buffer (vLLM's mirrored tensors) may have none
        can_stage = host.storage is not None
        if mode == "staged" and not can_stage:
            raise ValueError("staged copies need a host buffer with one storage; use 'direct'")
        self.mode = ("staged" if self.is_cuda and can_stage else "direct") if mode == "auto" \
            else mode
        self._block_bytes = self.layout.block_bytes
        # (device view, host view, block dim) per copy of a run, built once: the slab and
        # the host's [T, P, NB, E] view, or each physical tensor's [P, NB, E] pair
        host_view = host.canonical if can_stage else None
        slab = cache.canonical
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, int]] = (
            [(slab, host_view, 2)] if slab is not None and host_view is not None else [
                (dev, hst, 1)
                for dev, hst in zip(cache.tensor_views, host.tensor_views, strict=True)
            ]
        )

    # -- public API -------------------------------------------------------------------
    def save_to_host(
        self, ids: GroupedBlockIds | list[list[int]], *, trusted: bool = False
    ) -> CopyStats:
        """d2h: device blocks -> host buffer (prefill side)."""
        return self.copy(ids, Direction.D2H, trusted=trusted)

    def load_to_device(
        self, ids: GroupedBlockIds | list[list[int]], *, trusted: bool = False
    ) -> CopyStats:
        """h2d: host buffer -> device blocks (decode side)."""
        return self.copy(ids, Direction.H2D, trusted=trusted)

    def plan(self, ids: GroupedBlockIds | list[list[int]], *, trusted: bool = False) -> CopyPlan:
        return plan_copy(self.layout, self._ids(ids, trusted), max_temp_bytes=self.max_temp_bytes)

    def copy(
        self, ids: GroupedBlockIds | list[list[int]], direction: Direction, *,
        trusted: bool = False,
    ) -> CopyStats:
        """Copy a request's blocks; everything is validated before a byte moves.

        ``trusted=True`` skips the per-id checks of list input (`GroupedBlockIds`): for
        ids the engine's own allocator produced (vLLM's scheduler, a `BlockPool`).
        """
        if direction.__class__ is not Direction:
            direction = Direction(direction)
        grouped = self._ids(ids, trusted)
        plan = plan_copy(self.layout, grouped, max_temp_bytes=self.max_temp_bytes)
        return self.run(plan, direction)

    def run(self, plan: CopyPlan, direction: Direction, *, sync: bool = True) -> CopyStats:
        """Execute a plan (from `plan`, or `plan_copy` over validated ids). ``sync``
        False (CUDA): return once the copies are queued on the current stream; the caller
        synchronises (`kvstage.pd.saves` records an event on its copy stream)."""
        if plan.num_blocks:
            if self.mode == "direct":
                self._direct(plan.run_list, direction)
            else:
                self._staged(plan, direction)
            if sync:
                self._sync()
        return self.stats(plan, direction)

    def stats(self, plan: CopyPlan, direction: Direction) -> CopyStats:
        """What running ``plan`` moves and how (known before it runs)."""
        num_blocks = plan.num_blocks
        num_runs = 0 if not num_blocks else (
            len(plan.run_list) if self.mode == "direct" else plan.num_runs)
        chunks = plan.num_chunks if self.mode == "staged" else 0
        ops = (num_runs * len(self._pairs) if self.mode == "direct"
               else chunks * len(self._pairs) + len(plan.pieces))
        return CopyStats(direction, num_blocks, num_runs, chunks, num_blocks * self._block_bytes,
                         ops)

    def ops_for_runs(self, runs: np.ndarray) -> int:
        """Copy calls `copy_runs` makes for ``[R, 3]`` runs (one per run per pair)."""
        return int(runs.shape[0]) * len(self._pairs)

    def copy_runs(
        self, runs: np.ndarray | list[tuple[int, int, int]], direction: Direction, *,
        sync: bool = True,
    ) -> None:
        """Direct copies of ``[R, 3]`` (src, dst, n) block runs (the decode pipeline's
        chunks); ids must be validated by the caller. ``sync`` as in `run`."""
        self._direct(runs.tolist() if isinstance(runs, np.ndarray) else runs, direction)
        if sync:
            self._sync()

    # -- fused ----------------------------------------------------------------------------
    def _direct(self, runs: list[tuple[int, int, int]], direction: Direction) -> None:
        """One strided slice copy per run: over every tensor and plane at once when the
        cache is a slab, else per physical tensor."""
        nb = self.is_cuda
        pairs = self._pairs
        if direction is Direction.D2H:
            for s, d, n in runs:
                for dev, hst, dim in pairs:
                    hst.narrow(dim, d, n).copy_(dev.narrow(dim, s, n), non_blocking=nb)
        else:
            for s, d, n in runs:
                for dev, hst, dim in pairs:
                    dev.narrow(dim, d, n).copy_(hst.narrow(dim, s, n), non_blocking=nb)

    def _staged(self, plan: CopyPlan, direction: Direction) -> None:
        """Per chunk: one gather (d2h) or scatter (h2d) kernel per device tensor (one for
        a slab) between the cache and a contiguous staging buffer, and one contiguous DMA
        per run piece between staging and the host. Staging holds at most
        ``plan.chunk_blocks`` blocks.
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
        bdim = 0 if block_major else 2
        slab = self.cache.canonical
        if slab is not None:
            devs = [slab.view(dtype)]
        else:
            devs = [v.view(dtype).unsqueeze(0) for v in self.cache.tensor_views]
        # [NB, t, P, E] block-major or [t, P, NB, E] mirror, per device tensor (or slab)
        dev_blocks = [d.permute(2, 0, 1, 3) if block_major else d for d in devs]
        tdim = 1 if block_major else 0
        widths = [d.shape[tdim] for d in dev_blocks]
        ids_all = plan.block_ids
        for k, (first, end) in enumerate(plan.chunks.tolist()):
            lo = k * plan.chunk_blocks
            hi = min(lo + plan.chunk_blocks, plan.num_blocks)
            idx = self._index(ids_all[lo:hi])
            view = staging.narrow(bdim, 0, hi - lo)
            parts = _split(view, tdim, widths)
            pieces = plan.pieces[first:end].tolist()
            if direction is Direction.D2H:
                for dev, part in zip(dev_blocks, parts, strict=True):
                    if len(parts) == 1:
                        torch.index_select(dev, bdim, idx, out=part)
                    else:
                        part.copy_(dev.index_select(bdim, idx))
                for s, _d, n, off in pieces:
                    self._dma(self._host_run(s, n), view.narrow(bdim, off, n))
            else:
                for s, _d, n, off in pieces:
                    self._dma(view.narrow(bdim, off, n), self._host_run(s, n))
                for dev, part in zip(dev_blocks, parts, strict=True):
                    dev.index_copy_(bdim, idx, part)

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
        idx = torch.from_numpy(np.array(ids, dtype=np.int64))  # own, writable copy
        if self.is_cuda:
            idx = idx.pin_memory().to(self.cache.device, non_blocking=True)
        return idx

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.current_stream(self.cache.device).synchronize()

    def _ids(
        self, ids: GroupedBlockIds | list[list[int]], trusted: bool = False
    ) -> GroupedBlockIds:
        if isinstance(ids, GroupedBlockIds):
            if ids.num_blocks != self.layout.num_blocks or ids.num_groups != self.layout.num_groups:
                raise LayoutMismatch(
                    f"ids validated for {ids.num_groups} groups x {ids.num_blocks} blocks; "
                    f"this engine's layout has {self.layout.num_groups} x {self.layout.num_blocks}"
                )
            return ids
        return GroupedBlockIds(ids, self.layout, trusted=trusted)


def _split(view: torch.Tensor, dim: int, widths: list[int]) -> list[torch.Tensor]:
    if len(widths) == 1:
        return [view]
    return list(view.split(widths, dim=dim))
