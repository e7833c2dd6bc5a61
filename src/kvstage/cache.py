"""Device KV caches (kvstage's own slab, or tensors an engine owns) and host buffers.

Contract:
- The ENGINE owns the device tensors. `KVCache.wrap(layout, tensors)` takes one tensor
  per physical tensor (vLLM's ``KVCacheTensor``: layers of different groups alias it)
  and never copies or reallocates them; `KVCache.wrap_layers` takes vLLM's
  ``{layer_name: tensor}`` dict and dedupes aliases by storage. `KVCache(layout)`
  allocates kvstage's own slab (the CLI, demo and benches).
- kvstage owns the host buffer: ONE allocation for every physical tensor (pinned where
  the device is CUDA), so host bytes equal the device pool, never groups x the pool.
  `HostBuffer.wrap_layers(layout, layers)` instead wraps host tensors a caller allocated
  as a mirror of the device (the vLLM connector's, whose raw bytes NIXL reads as the
  peer's device layout): ``MIRROR`` layout, nothing copied, no ``descriptors``.

Every physical tensor is addressed as ``[num_planes, num_blocks, plane_elems]``
(`KVCache.tensor_views`); when they are evenly spaced in one storage (kvstage's slab,
or vLLM's one backing buffer) the whole cache is also one ``[T, P, NB, E]`` view
(`KVCache.canonical`), and the engine copies a run of blocks of every tensor in one op.

Host layouts:
- ``HostLayout.BLOCK_MAJOR`` (default): storage ``[num_blocks, num_tensors, planes, E]``;
  a block's bytes for every tensor are one contiguous row, so a run of n blocks is one
  host range (one copy op, one network descriptor).
- ``HostLayout.MIRROR``: storage mirrors the device ``[num_tensors, planes, num_blocks, E]``;
  a run is one range per tensor per plane.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from kvstage.errors import LayoutMismatch
from kvstage.layout import CacheLayout, KVGroup, KVLayout, KVSpec
from kvstage.pinned import pinned_bytes


class HostLayout(enum.Enum):
    BLOCK_MAJOR = "block_major"
    MIRROR = "mirror"


def _layer_shape(layout: KVLayout, spec: KVSpec) -> tuple[int, ...]:
    block = spec.block_shape
    if layout.cache_layout is CacheLayout.KV_SPLIT:
        return (2, layout.num_blocks, *block[1:])
    return (layout.num_blocks, *block)


def _layer_views(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-layer views of per-tensor ``[P, NB, E]`` views (aliasing across groups)."""
    views: dict[str, torch.Tensor] = {}
    for group in layout.groups:
        shape = _layer_shape(layout, group.spec)
        for t, name in enumerate(group.layer_names):
            plane = tensors[t]  # [P, NB, E]
            if plane.dtype != group.spec.torch_dtype:  # a byte-addressed (mixed-dtype) pool
                plane = plane.view(group.spec.torch_dtype)
            if layout.cache_layout is CacheLayout.PACKED:
                views[name] = plane[0].unflatten(-1, shape[1:])
            else:
                views[name] = plane.unflatten(-1, shape[2:])
    return views


def _is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _as_tensor_view(layout: KVLayout, t: torch.Tensor, what: str) -> torch.Tensor:
    """An engine tensor -> its ``[P, NB, E]`` view, or LayoutMismatch saying why not."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    _, p, nb, e = layout.canonical_shape
    if t.dtype != layout.torch_dtype:
        raise LayoutMismatch(
            f"{what} has dtype {t.dtype}, the layout {layout.name or ''} needs "
            f"{layout.torch_dtype}; view the engine's buffer with that dtype first"
        )
    if t.numel() != p * nb * e:
        raise LayoutMismatch(
            f"{what} has {t.numel()} elements (shape {list(t.shape)}); the layout needs "
            f"{p * nb * e} = {nb} blocks x {p * e} per block; build the layout with the "
            "engine's num_blocks and specs"
        )
    block_dim = layout.cache_layout.block_dim
    if t.dim() < 2 or t.shape[block_dim] != nb:
        raise LayoutMismatch(
            f"{what} has shape {list(t.shape)}: expected num_blocks={nb} on dim {block_dim} "
            f"({layout.cache_layout.value} cache layout)"
        )
    try:
        return t.view(p, nb, e)
    except RuntimeError:
        raise LayoutMismatch(
            f"{what} (shape {list(t.shape)}, stride {list(t.stride())}) is not laid out "
            f"as {'[2, num_blocks, ...]' if p == 2 else '[num_blocks, ...]'} in memory; "
            "pass the engine's underlying per-tensor buffer, not a permuted view"
        ) from None


def _slab_of(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[T, P, NB, E]`` view over evenly spaced per-tensor views, else None."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    storage = first.untyped_storage().data_ptr()
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0]
    if any(v.untyped_storage().data_ptr() != storage for v in views):
        return None
    if any(v.stride() != first.stride() for v in views):
        return None
    if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), offsets[0])


class KVCache:
    """A device KV cache: per-physical-tensor ``[P, NB, E]`` views, and one ``[T, P, NB, E]``
    view when they form a slab."""

    def __init__(self, layout: KVLayout, device: str | torch.device = "cpu") -> None:
        """Allocate kvstage's own slab ``[T, P, NB, E]`` (zeroed: every page touched now)."""
        dev = torch.device(device)
        if _is_cuda(dev) and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but torch.cuda.is_available() is False")
        slab = torch.zeros(layout.canonical_shape, dtype=layout.torch_dtype, device=dev)
        self._init(layout, list(slab.unbind(0)), slab, owned=True)

    def _init(self, layout: KVLayout, views: list[torch.Tensor], slab: torch.Tensor | None,
              *, owned: bool) -> None:
        self.layout = layout
        self.device = views[0].device
        self.tensor_views = views
        self.slab = slab
        self.owned = owned

    @classmethod
    def wrap(cls, layout: KVLayout, tensors: Sequence[torch.Tensor] | torch.Tensor) -> KVCache:
        """Wrap tensors the engine allocated; nothing is copied.

        ``tensors``: one per physical tensor (``layout.num_tensors``), each holding
        ``num_blocks`` blocks with the block dim where the cache layout puts it
        (``[num_blocks, ...]`` packed, ``[2, num_blocks, ...]`` K/V split) and contiguous
        in that order; or one slab ``[num_tensors, ...]``. All on one device.
        """
        if isinstance(tensors, torch.Tensor):
            if tensors.dim() < 1 or tensors.shape[0] != layout.num_tensors:
                raise LayoutMismatch(
                    f"a slab must be [num_tensors={layout.num_tensors}, ...], got shape "
                    f"{list(tensors.shape)}"
                )
            tensors = list(tensors.unbind(0))
        tensors = list(tensors)
        if len(tensors) != layout.num_tensors:
            raise LayoutMismatch(
                f"got {len(tensors)} tensors, the layout has {layout.num_tensors} physical "
                "tensors (one per layer position shared by the groups); pass one per "
                "physical tensor, or use KVCache.wrap_layers with the engine's layer dict"
            )
        views = [_as_tensor_view(layout, t, f"tensor {i}") for i, t in enumerate(tensors)]
        devices = {v.device for v in views}
        if len(devices) != 1:
            raise LayoutMismatch(f"tensors are on {sorted(map(str, devices))}; need one device")
        cache = cls.__new__(cls)
        cache._init(layout, views, _slab_of(views), owned=False)
        return cache

    @classmethod
    def wrap_layers(cls, layout: KVLayout, layers: Mapping[str, torch.Tensor]) -> KVCache:
        """Wrap vLLM's ``{layer_name: tensor}``: layer t of every group must alias one
        storage (vLLM's ``KVCacheTensor.shared_by``); the first group's layer is used."""
        missing = [n for g in layout.groups for n in g.layer_names if n not in layers]
        if missing:
            raise LayoutMismatch(
                f"layer dict lacks {len(missing)} of the layout's layers (e.g. {missing[0]!r})"
            )
        tensors = []
        for pt in layout.tensors:
            first = layers[pt.layer_names[0]]
            for name in pt.layer_names[1:]:
                other = layers[name]
                if other.data_ptr() != first.data_ptr() or other.shape != first.shape:
                    raise LayoutMismatch(
                        f"layers {pt.layer_names[0]!r} and {name!r} share physical tensor "
                        f"{pt.tensor_id} in the layout but not in memory; derive the layout "
                        "with layout_from_layers"
                    )
            tensors.append(first)
        return cls.wrap(layout, tensors)

    @property
    def canonical(self) -> torch.Tensor | None:
        """``[T, P, NB, E]`` when the tensors form a slab, else None (copy per tensor)."""
        return self.slab

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensor_views)

    def layer_caches(self) -> dict[str, torch.Tensor]:
        """``{layer_name: tensor}`` shaped as vLLM's attention backends lay them out."""
        return _layer_views(self.layout, self.tensor_views)

    def fill_random(self, seed: int) -> None:
        """Random (never constant) bytes, so a misplaced block cannot compare equal."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for v in self.tensor_views:
            nbytes = v.numel() * v.element_size()
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            if self.layout.torch_dtype.is_floating_point:
                # keep floats finite: clear the exponent's top bit of every element
                raw.view(-1, v.element_size())[:, -1] &= 0x3F
            v.view(torch.uint8).view(-1).copy_(raw.to(self.device))


def layout_from_layers(
    layers: Mapping[str, torch.Tensor],
    groups: Sequence[tuple[Sequence[str], KVSpec]],
    *,
    cache_layout: CacheLayout = CacheLayout.PACKED,
    name: str = "",
) -> KVLayout:
    """Derive a `KVLayout` from an engine's ``{layer_name: tensor}`` and its groups.

    Layers are deduplicated by storage (data_ptr): every distinct storage is one
    physical tensor, and each group's layers are reordered so that position t of every
    group names physical tensor t (tensors shared by more groups first, as vLLM pads the
    smaller groups at the end). Raises LayoutMismatch if one group has two layers on one
    storage, or if the sharing cannot be expressed by position.
    """
    if not groups:
        raise LayoutMismatch("need at least one group of (layer_names, spec)")
    key_of: dict[str, int] = {}
    for names, _spec in groups:
        for n in names:
            if n not in layers:
                raise LayoutMismatch(f"group layer {n!r} is not in the layer dict")
            key_of[n] = int(layers[n].data_ptr())
    storages: dict[int, int] = {}  # storage -> groups sharing it, in first-seen order
    for names, _spec in groups:
        seen = [key_of[n] for n in names]
        if len(set(seen)) != len(seen):
            raise LayoutMismatch(
                f"two layers of one group alias one storage ({list(names)[:4]}...): a group "
                "must own one physical tensor per layer"
            )
        for k in seen:
            storages[k] = storages.get(k, 0) + 1
    # most shared first (vLLM pads the smaller groups at the end), then first seen
    order = sorted(storages, key=lambda k: -storages[k])
    index = {k: i for i, k in enumerate(order)}
    built = []
    for gid, (names, spec) in enumerate(groups):
        ordered = sorted(names, key=lambda n: index[key_of[n]])
        positions = [index[key_of[n]] for n in ordered]
        if positions != list(range(len(ordered))):
            raise LayoutMismatch(
                f"group {gid} uses physical tensors {positions}; kvstage needs every group "
                "to use tensors 0..n-1 (the most shared first)"
            )
        built.append(KVGroup(group_id=gid, layer_names=tuple(ordered), spec=spec))
    first = layers[built[0].layer_names[0]]
    block_dim = cache_layout.block_dim
    return KVLayout(
        num_blocks=int(first.shape[block_dim]), groups=tuple(built),
        cache_layout=cache_layout, name=name,
    )


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
        if pin_memory:  # exactly the pool's bytes, page-locked (kvstage.pinned: why)
            nbytes = math.prod(shape) * torch.empty((), dtype=layout.torch_dtype).element_size()
            self.storage = pinned_bytes(nbytes).view(layout.torch_dtype).view(shape)
        else:
            self.storage = torch.empty(shape, dtype=layout.torch_dtype)
            # fault every page in at start-up: torch.zeros maps lazily (calloc), and a first
            # READ into untouched pages is several times slower (BENCHMARKS.md)
            self.storage.zero_()
        self.pinned = pin_memory
        self._views: list[torch.Tensor] | None = None  # set by wrap_layers only

    @classmethod
    def wrap_layers(cls, layout: KVLayout, layers: Mapping[str, torch.Tensor]) -> HostBuffer:
        """Wrap a caller's host tensors ``{layer_name: tensor}`` laid out as the device's
        (same checks as `KVCache.wrap_layers`); nothing is copied. ``storage`` is the
        ``[T, P, NB, E]`` view when the tensors form a slab, else None (then a `CopyEngine`
        copies per physical tensor, ``direct`` mode)."""
        wrapped = KVCache.wrap_layers(layout, layers)
        if wrapped.device.type != "cpu":
            raise ValueError(f"a host buffer lives on the CPU, got tensors on {wrapped.device}")
        buf = cls.__new__(cls)
        buf.layout = layout
        buf.host_layout = HostLayout.MIRROR
        buf.storage = wrapped.slab  # type: ignore[assignment]
        buf.pinned = all(v.is_pinned() for v in wrapped.tensor_views)
        buf._views = wrapped.tensor_views
        return buf

    @property
    def tensor_views(self) -> list[torch.Tensor]:
        """Per physical tensor ``[P, NB, E]`` views (what a copy pairs with the device's)."""
        if self._views is not None:
            return self._views
        return list(self.canonical.unbind(0))

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
        """``[T, P, NB, E]`` view of the storage (wrapped tensors that form no slab have
        none: see ``tensor_views``)."""
        if self.storage is None:
            raise ValueError("this wrapped host buffer is not one slab; use tensor_views")
        return self.storage.permute(1, 2, 0, 3) if self.block_major else self.storage

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensor_views)

    @property
    def data_ptr(self) -> int:
        return int(self.storage.data_ptr())

    def layer_views(self) -> dict[str, torch.Tensor]:
        return _layer_views(self.layout, self.tensor_views)

    def descriptors(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``[N, 2]`` int64 (addr, nbytes) covering blocks [start, start + length) of every
        tensor: one row per range in block-major, one per range per tensor per plane in
        mirror (tensor-major order)."""
        if self._views is not None:
            raise ValueError("a wrapped host buffer is described by its owner (vLLM), not here")
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
