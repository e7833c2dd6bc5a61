"""Host buffers that alias like vLLM's device KV cache, and the fused copy between them.

Contract
--------
Primitives (torch only: importing this module never imports vLLM):
- `mirror_host_buffers(device_caches)`: ``{layer_name: host view}`` with ONE host allocation
  per distinct device storage; each layer name's host view has its device view's dtype,
  shape, strides and storage offset. So layers that alias on the device alias on the host
  (vLLM 0.32.0 overlays its KV cache groups in one int8 backing buffer), host bytes equal
  the device pool (not groups x pool, as vLLM's one-``torch.empty``-per-layer-name buffers),
  and raw bytes at one offset mean the same on both sides (NIXL reads host bytes as the
  peer's device layout).
- `BlockCopier(device_caches, host_caches)`: the copy both directions use. It keeps one
  layer name per distinct view (storage, offset, dtype, shape, stride): copying an alias
  again would write the same bytes. ``copier(src, dst, src_ids, dst_ids, direction)`` has
  vLLM's ``CopyBlocksOp`` signature; it copies each distinct view once per run of
  consecutive (src, dst) ids, a slice ``copy_`` along dim 0 (vLLM 0.32.0's packed layouts
  keep blocks on dim 0).

Ownership: the caller (the connector) owns the device caches; the host allocations are
owned by the returned views. Nothing here keeps a thread or global state.

Validation: ids must lie in ``[0, num_blocks)`` of their side, the two lists must have one
length, and a destination id may not get two different sources; ``ValueError`` says what
arrived before a byte moves. Repeated identical pairs (vLLM pads sliding-window groups with
the null block 0) are copied once. CUDA copies are non-blocking with one synchronise at the
end (vLLM's host path expects the copy to be complete on return).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

_ViewKey = tuple[int, int, torch.dtype, tuple[int, ...], tuple[int, ...]]


def _view_key(t: torch.Tensor) -> _ViewKey:
    return (
        t.untyped_storage().data_ptr(),
        int(t.storage_offset()),
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()),
    )


def mirror_host_buffers(
    device_caches: Mapping[str, torch.Tensor], *, pin_memory: bool | None = None
) -> dict[str, torch.Tensor]:
    """One host allocation per distinct device storage, layer names viewing it as on device.

    ``pin_memory`` defaults to True when the device caches are on CUDA (page-locked host
    memory makes the copies DMA, without a staging copy).
    """
    if not device_caches:
        raise ValueError("no device KV caches to mirror: got an empty dict")
    devices = {t.device.type for t in device_caches.values()}
    if pin_memory is None:
        pin_memory = "cuda" in devices
    storages: dict[int, torch.Tensor] = {}
    views: dict[str, torch.Tensor] = {}
    for name, cache in device_caches.items():
        storage = cache.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in storages:
            # Round up to 8 bytes so any dtype can view the allocation.
            nbytes = -(-storage.nbytes() // 8) * 8
            storages[ptr] = torch.zeros(nbytes, dtype=torch.int8, pin_memory=pin_memory)
        host = storages[ptr].view(cache.dtype)
        views[name] = torch.as_strided(host, cache.shape, cache.stride(), cache.storage_offset())
    return views


def host_nbytes(caches: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the distinct allocations behind ``caches`` (aliases counted once)."""
    seen: dict[int, int] = {}
    for t in caches.values():
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def find_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs covering the distinct (src, dst) pairs."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(
            f"src_block_ids has {len(src_ids)} ids but dst_block_ids has {len(dst_ids)}: "
            "they pair up one to one"
        )
    pairs = sorted(set(zip(src_ids, dst_ids, strict=True)), key=lambda p: (p[1], p[0]))
    runs: list[tuple[int, int, int]] = []
    prev_dst = None
    for s, d in pairs:
        if d == prev_dst:
            raise ValueError(f"destination block {d} is given two different sources")
        prev_dst = d
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


class BlockCopier:
    """vLLM's ``CopyBlocksOp`` over mirrored caches: one copy per distinct view per run."""

    def __init__(
        self, device_caches: Mapping[str, torch.Tensor], host_caches: Mapping[str, torch.Tensor]
    ) -> None:
        if device_caches.keys() != host_caches.keys():
            raise ValueError("device and host caches must have the same layer names")
        seen: dict[_ViewKey, str] = {}
        for name, t in device_caches.items():
            seen.setdefault(_view_key(t), name)
        for name in seen.values():
            d, h = device_caches[name], host_caches[name]
            if d.shape != h.shape or d.dtype != h.dtype:
                raise ValueError(
                    f"layer {name!r}: device {tuple(d.shape)} {d.dtype} but host "
                    f"{tuple(h.shape)} {h.dtype}; build the host side with mirror_host_buffers"
                )
        #: one layer name per distinct device view, in the caches' order
        self.layer_names: list[str] = list(seen.values())

    def __call__(
        self,
        src_caches: Mapping[str, torch.Tensor],
        dst_caches: Mapping[str, torch.Tensor],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        direction: Literal["h2d", "d2h"],
    ) -> None:
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
        runs = find_runs(src_block_ids, dst_block_ids)
        if not runs:
            return
        first = self.layer_names[0]
        src_blocks, dst_blocks = src_caches[first].shape[0], dst_caches[first].shape[0]
        for s, d, n in runs:
            if s < 0 or d < 0 or s + n > src_blocks or d + n > dst_blocks:
                raise ValueError(
                    f"block ids out of range: run src {s}..{s + n - 1} (of {src_blocks}), "
                    f"dst {d}..{d + n - 1} (of {dst_blocks})"
                )
        cuda = {
            t.device
            for caches in (src_caches, dst_caches)
            for t in (caches[first],)
            if t.device.type == "cuda"
        }
        for name in self.layer_names:
            src, dst = src_caches[name], dst_caches[name]
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n], non_blocking=bool(cuda))
        for device in cuda:
            torch.cuda.synchronize(device)
