"""Host buffers that alias like vLLM's device KV cache.

Contract
--------
Primitives (torch only: importing this module never imports vLLM):
- `mirror_host_buffers(device_caches)`: ``{layer_name: host view}`` with ONE host allocation
  per distinct device storage; each layer name's host view has its device view's dtype,
  shape, strides and storage offset. So layers that alias on the device alias on the host
  (vLLM 0.32.0 overlays its KV cache groups in one int8 backing buffer), host bytes equal
  the device pool (not groups x pool, as vLLM's one-``torch.empty``-per-layer-name buffers),
  and raw bytes at one offset mean the same on both sides (NIXL reads host bytes as the
  peer's device layout). The copies between the two are kvstage's `CopyEngine`
  (`kvstage.integrations.vllm.copies`).
- `host_nbytes(caches)`: bytes of the distinct allocations behind a dict of views.

Ownership: the caller (the connector) owns the device caches; the host allocations are
owned by the returned views. Nothing here keeps a thread or global state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvstage.pinned import pinned_bytes


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
            # pinned: exactly nbytes page-locked, not torch's power-of-two block (pinned.py)
            storages[ptr] = (pinned_bytes(nbytes).view(torch.int8) if pin_memory
                             else torch.zeros(nbytes, dtype=torch.int8))
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
