"""The d2h and h2d of prefill and decode at different TP sizes: heads gathered into parts.

Contract
--------
`HostPart(host, parts, index)`: part ``index`` of a `HostBuffer` read as ``[K, NB, T,
page/K]`` (`kvstage.pd.tp_parts`): rows of ``parts.row_bytes`` (a block's part over every
tensor), one contiguous range per run of blocks. It has what the READ, the checksums and
the registration ask of a host buffer (``storage`` ``[NB, row]`` bytes, ``data_ptr``,
``nbytes``, ``descriptors``, ``block_major``, ``layout``).

`PartCopy(cache, host, parts, region=None)`: the copy engine of one rank across sizes,
with `CopyEngine`'s calls (``plan``, ``run``, ``stats``, ``copy_runs``, ``load_to_device``).
The prefill's (``region=None``) d2h gathers every part of each block: per run of one
group's blocks, per part, per segment one strided ``copy_`` over every tensor at once (a
head-major attention page: one segment per part; a Mamba2 page, DS conv: four). A decode
region's (``region=j``) h2d scatters part j the same way. The group of a block id decides
its segments (layers of different groups share tensors): ``plan`` and ``assign`` record
it per id, as vLLM's block pool hands ids to one group at a time.

Ownership: the cache's tensors are the engine's (views, no copy); the host buffer is the
caller's. CPU and CUDA alike: on CUDA the copies are non-blocking on the current stream
and ``run(sync=True)`` synchronises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvstage.blocks import GroupedBlockIds
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.engine import CopyStats, Direction
from kvstage.errors import LayoutMismatch
from kvstage.layout import KVLayout
from kvstage.pd.tp_parts import PageParts
from kvstage.plan import runs_of_ids

__all__ = ["HostPart", "PartCopy", "PartPlan", "host_for"]


class HostPart:
    """Part ``index`` of ``host`` as rows of ``parts.row_bytes`` (module doc)."""

    host_layout = HostLayout.BLOCK_MAJOR
    block_major = True

    def __init__(self, host: HostBuffer, parts: PageParts, index: int) -> None:
        if not host.block_major or host.storage is None:
            raise LayoutMismatch("parts of a host buffer need its block-major storage")
        nb = host.layout.num_blocks
        if host.nbytes != nb * parts.num_parts * parts.row_bytes:
            raise LayoutMismatch(f"a host buffer of {host.nbytes} B is not {parts.num_parts} "
                                 f"parts of {nb} rows of {parts.row_bytes} B")
        if not 0 <= index < parts.num_parts:
            raise ValueError(f"part index must be in [0, {parts.num_parts}), got {index}")
        self.layout: KVLayout = host.layout
        self.parent, self.parts, self.index = host, parts, index
        raw = host.storage.view(-1).view(torch.uint8).view(parts.num_parts, nb, parts.row_bytes)
        self.storage = raw[index]
        self.pinned = host.pinned

    @property
    def data_ptr(self) -> int:
        return int(self.storage.data_ptr())

    @property
    def nbytes(self) -> int:
        return int(self.storage.numel())

    def descriptors(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``[N, 2]`` (addr, nbytes): one row per run of this part's blocks."""
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        row = self.parts.row_bytes
        return np.stack((self.data_ptr + starts * row, lengths * row), axis=1)


@dataclass(frozen=True)
class PartPlan:
    """A request's blocks as runs of one group: ``[(group, first id, n), ...]``."""

    runs: tuple[tuple[int, int, int], ...]
    num_blocks: int


def _group_runs(ids: GroupedBlockIds) -> list[tuple[int, int, int]]:
    """(group, first id, n) per run of each group's ids (`plan.runs_of_ids`)."""
    return [(g, int(start), int(n)) for g, group in enumerate(ids.groups)
            for start, _, n in runs_of_ids(list(group))]


class PartCopy:
    """Gathers every part (prefill) or scatters one region (decode): module doc."""

    def __init__(self, cache: KVCache, host: HostBuffer, parts: PageParts, *,
                 region: int | None = None) -> None:
        layout = cache.layout
        if cache.layout != host.layout:
            raise LayoutMismatch("device cache and host buffer were built for different "
                                 "layouts; build both from one KVLayout")
        if layout.num_planes != 1 or len(parts.groups) != layout.num_groups:
            raise LayoutMismatch(
                f"kvstage cuts pages of one plane per block into parts; this layout has "
                f"{layout.num_planes} planes and {layout.num_groups} groups for "
                f"{len(parts.groups)} cut")
        if layout.page_size_bytes != parts.page_bytes or layout.num_tensors != parts.num_tensors:
            raise LayoutMismatch(
                f"parts were cut for {parts.num_tensors} tensors of {parts.page_bytes} B "
                f"pages; this cache has {layout.num_tensors} of {layout.page_size_bytes} B")
        self.cache, self.host, self.layout, self.parts = cache, host, layout, parts
        self.region = region
        self.is_cuda = cache.device.type == "cuda"
        nb = layout.num_blocks
        slab = cache.canonical  # [T, P, NB, E] or None
        if slab is not None:
            self._dev = [slab[:, 0].view(torch.uint8).permute(1, 0, 2)]  # [NB, T, page]
        else:
            self._dev = [v[0].view(torch.uint8).unsqueeze(1) for v in cache.tensor_views]
        raw = host.storage.view(-1).view(torch.uint8)
        self._host = raw.view(parts.num_parts, nb, parts.num_tensors, parts.part_bytes)
        self._owner = np.zeros(nb, np.int64)  # the group each block id was last given to
        self._block_bytes = layout.block_bytes

    # -- what CopyEngine offers --------------------------------------------------------
    def assign(self, ids: GroupedBlockIds | list[list[int]]) -> None:
        """Record which group each id belongs to (the decode's local ids, at start)."""
        groups = ids.groups if isinstance(ids, GroupedBlockIds) else ids
        for g, group in enumerate(groups):
            real = [int(b) for b in group if b]
            if real:
                self._owner[real] = g

    def plan(self, ids: GroupedBlockIds | list[list[int]], *, trusted: bool = False
             ) -> PartPlan:
        grouped = ids if isinstance(ids, GroupedBlockIds) else GroupedBlockIds(
            ids, self.layout, trusted=trusted)
        self.assign(grouped)
        runs = _group_runs(grouped)
        return PartPlan(runs=tuple(runs), num_blocks=sum(n for _, _, n in runs))

    def stats(self, plan: PartPlan, direction: Direction) -> CopyStats:
        return CopyStats(direction, plan.num_blocks, len(plan.runs), 0,
                         plan.num_blocks * self._block_bytes, self.ops(plan, direction))

    def ops(self, plan: PartPlan, direction: Direction) -> int:
        """copy_ calls ``run`` makes for ``plan``."""
        return self._ops([g for g, _, _ in plan.runs])

    def ops_for_runs(self, runs: np.ndarray) -> int:
        """copy_ calls `copy_runs` makes for ``[R, 3]`` runs (split where the group of the
        device blocks changes)."""
        return self._ops([g for g, _, _, _ in self._pieces(runs.tolist())])

    def _ops(self, groups: list[int]) -> int:
        parts = range(self.parts.num_parts) if self.region is None else [self.region]
        return len(self._dev) * sum(
            len(self.parts.groups[g].segments[p]) for g in groups for p in parts)

    def run(self, plan: PartPlan, direction: Direction, *, sync: bool = True) -> CopyStats:
        self._copy([(g, s, s, n) for g, s, n in plan.runs], direction)
        if sync:
            self._sync()
        return self.stats(plan, direction)

    def copy(self, ids: GroupedBlockIds | list[list[int]], direction: Direction, *,
             trusted: bool = False) -> CopyStats:
        return self.run(self.plan(ids, trusted=trusted), direction)

    def save_to_host(self, ids: GroupedBlockIds | list[list[int]], *,
                     trusted: bool = False) -> CopyStats:
        return self.copy(ids, Direction.D2H, trusted=trusted)

    def load_to_device(self, ids: GroupedBlockIds | list[list[int]], *,
                       trusted: bool = False) -> CopyStats:
        return self.copy(ids, Direction.H2D, trusted=trusted)

    def copy_runs(self, runs: np.ndarray | list[tuple[int, int, int]], direction: Direction,
                  *, sync: bool = True) -> None:
        """``[R, 3]`` (host row, device block, n) runs: split where the group of the
        device blocks changes (the ids were recorded by ``plan`` or ``assign``)."""
        self._direct(runs.tolist() if isinstance(runs, np.ndarray) else runs, direction)
        if sync:
            self._sync()

    def _direct(self, runs: list[tuple[int, int, int]] | list[list[int]],
                direction: Direction) -> None:
        self._copy(self._pieces(runs), direction)

    def _pieces(self, runs: list[tuple[int, int, int]] | list[list[int]]
                ) -> list[tuple[int, int, int, int]]:
        """(group, host row, device block, n): ``runs`` cut where the group changes."""
        pieces = []
        for s, d, n in runs:
            owners = self._owner[d:d + n]
            cuts = np.flatnonzero(np.diff(owners)) + 1
            for a, b in zip(np.concatenate(([0], cuts)), np.concatenate((cuts, [n])),
                            strict=True):
                pieces.append((int(owners[a]), s + int(a), d + int(a), int(b - a)))
        return pieces

    # -- the copies --------------------------------------------------------------------
    def _copy(self, pieces: list[tuple[int, int, int, int]], direction: Direction) -> None:
        """(group, host row, device block, n): per part, per segment, per device view."""
        nb = self.is_cuda
        parts = range(self.parts.num_parts) if self.region is None else [self.region]
        for g, s, d, n in pieces:
            segments = self.parts.groups[g].segments
            for p in parts:
                host = self._host[p, s:s + n]  # [n, T, part]
                for src, dst, size in segments[p]:
                    t0 = 0
                    for dev in self._dev:
                        t = dev.shape[1]
                        h = host[:, t0:t0 + t, dst:dst + size]
                        v = dev[d:d + n, :, src:src + size]
                        if direction is Direction.D2H:
                            h.copy_(v, non_blocking=nb)
                        else:
                            v.copy_(h, non_blocking=nb)
                        t0 += t

    def _sync(self) -> None:
        if self.is_cuda:
            torch.cuda.current_stream(self.cache.device).synchronize()


def host_for(cache: KVCache) -> HostBuffer:
    """The one host buffer the R decode regions of a rank share (the device pool's bytes,
    pinned on CUDA): each region's `kvstage.pd.decode.DecodeWorker` registers its part."""
    return HostBuffer.for_device(cache.layout, cache.device)
