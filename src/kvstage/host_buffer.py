"""Device KV caches and host buffers, each ONE allocation for every physical tensor.

Both expose a canonical view ``[num_tensors, num_planes, num_blocks, plane_elems]`` so
the copy engine addresses any layout the same way, plus the per-layer views vLLM hands
to a connector (layers of different groups alias the same physical tensor).

Host layouts:
- ``HostLayout.BLOCK_MAJOR`` (default): storage ``[num_blocks, num_tensors, planes, E]``;
  a block's bytes for every tensor are one contiguous row, so a run of n blocks is one
  host range (one copy op, one network descriptor).
- ``HostLayout.MIRROR``: storage mirrors the device ``[num_tensors, planes, num_blocks, E]``;
  a run is one range per tensor per plane.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from kvstage.layout import AttentionSpec, CacheLayout, KVLayout


class HostLayout(enum.Enum):
    BLOCK_MAJOR = "block_major"
    MIRROR = "mirror"


def _layer_shape(layout: KVLayout, spec: AttentionSpec) -> tuple[int, ...]:
    block = spec.block_shape
    if layout.cache_layout is CacheLayout.KV_SPLIT:
        return (2, layout.num_blocks, *block[1:])
    return (layout.num_blocks, *block)


def _layer_views(layout: KVLayout, canonical: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer views of a canonical ``[T, P, NB, E]`` tensor (aliasing across groups)."""
    views: dict[str, torch.Tensor] = {}
    for group in layout.groups:
        shape = _layer_shape(layout, group.spec)
        for t, name in enumerate(group.layer_names):
            plane = canonical[t]  # [P, NB, E]
            if layout.cache_layout is CacheLayout.PACKED:
                views[name] = plane[0].unflatten(-1, shape[1:])
            else:
                views[name] = plane.unflatten(-1, shape[2:])
    return views


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


class KVCache:
    """The device KV cache of a layout: one slab ``[T, P, NB, E]`` on ``device``."""

    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        if _is_cuda(self.device) and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but torch.cuda.is_available() is False")
        shape = layout.canonical_shape
        self.slab = torch.empty(shape, dtype=layout.torch_dtype, device=self.device)
        self.slab.zero_()  # touch every page now, not during the first copy

    @property
    def canonical(self) -> torch.Tensor:
        return self.slab

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def layer_caches(self) -> dict[str, torch.Tensor]:
        """``{layer_name: tensor}`` shaped as vLLM's attention backends lay them out."""
        return _layer_views(self.layout, self.slab)

    def fill_random(self, seed: int) -> None:
        """Random (never constant) bytes, so a misplaced block cannot compare equal."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        raw = torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=gen)
        if self.layout.torch_dtype.is_floating_point:
            # keep floats finite: clear the exponent's top bit of every element
            elem = self.slab.element_size()
            raw.view(-1, elem)[:, -1] &= 0x3F
        self.slab.view(-1).view(torch.uint8).copy_(raw.to(self.device))


class HostBuffer:
    """The host staging buffer of a layout: one allocation, pinned for CUDA devices."""

    def __init__(
        self,
        layout: KVLayout,
        host_layout: HostLayout = HostLayout.BLOCK_MAJOR,
        *,
        pin_memory: bool = False,
    ) -> None:
        if not isinstance(host_layout, HostLayout):
            raise TypeError(f"host_layout must be a HostLayout, got {host_layout!r}")
        self.layout = layout
        self.host_layout = host_layout
        t, p, nb, e = layout.canonical_shape
        shape = (nb, t, p, e) if host_layout is HostLayout.BLOCK_MAJOR else (t, p, nb, e)
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; pinned host memory is a CUDA concept")
        self.storage = torch.empty(shape, dtype=layout.torch_dtype, pin_memory=pin_memory)
        # fault every page in at start-up: torch.zeros maps lazily (calloc), and a first
        # READ into untouched pages measured several times slower here
        self.storage.zero_()
        self.pinned = pin_memory

    @classmethod
    def for_device(
        cls,
        layout: KVLayout,
        device: str | torch.device,
        host_layout: HostLayout = HostLayout.BLOCK_MAJOR,
    ) -> HostBuffer:
        """A host buffer pinned exactly when ``device`` is CUDA."""
        return cls(layout, host_layout, pin_memory=_is_cuda(torch.device(device)))

    @property
    def block_major(self) -> bool:
        return self.host_layout is HostLayout.BLOCK_MAJOR

    @property
    def canonical(self) -> torch.Tensor:
        """``[T, P, NB, E]`` view of the storage."""
        return self.storage.permute(1, 2, 0, 3) if self.block_major else self.storage

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    @property
    def data_ptr(self) -> int:
        return int(self.storage.data_ptr())

    def layer_views(self) -> dict[str, torch.Tensor]:
        return _layer_views(self.layout, self.canonical)

    def descriptors(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``[N, 2]`` int64 (addr, nbytes) covering blocks [start, start + length) of every
        tensor: one row per range in block-major, one per range per tensor per plane in
        mirror (tensor-major order)."""
        starts = np.asarray(starts, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        lay = self.layout
        if self.block_major:
            row = lay.block_bytes
            return np.stack((self.data_ptr + starts * row, lengths * row), axis=1)
        plane_bytes = lay.page_size_bytes // lay.num_planes
        planes = np.arange(lay.num_tensors * lay.num_planes, dtype=np.int64)
        base = self.data_ptr + planes[:, None] * (lay.num_blocks * plane_bytes)
        addr = (base + starts[None, :] * plane_bytes).reshape(-1)
        size = np.broadcast_to(lengths[None, :] * plane_bytes, (planes.size, starts.size))
        return np.stack((addr, size.reshape(-1)), axis=1)


def memory_report(layout: KVLayout) -> dict[str, int]:
    """Device pool bytes vs kvstage's host buffer vs vLLM's per-layer-name host buffers."""
    per_layer = layout.num_blocks * layout.page_size_bytes
    return {
        "device_bytes": layout.pool_bytes,
        "host_bytes": layout.pool_bytes,
        "vllm_host_bytes": layout.num_layers * per_layer,
    }
