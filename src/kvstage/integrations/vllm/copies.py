"""The connector's d2h and h2d: vLLM's ``CopyBlocksOp`` over kvstage's `CopyEngine`.

Contract
--------
Primitives (torch only: importing this module never imports vLLM):
- `kvstage_groups(groups, device_caches)`: vLLM's KV cache groups (``(layer_names, spec)``
  with vLLM's spec objects, read by attribute) as kvstage groups, the block size taken
  from the tensors (kernel blocks: what the ids passed to the op count in).
- `EngineCopyOp(device_caches, host_caches, groups)`: one `CopyEngine` over
  ``KVCache.wrap_layers`` of vLLM's device tensors and ``HostBuffer.wrap_layers`` of the
  mirrored host tensors (`host_buffers.mirror_host_buffers`: same offsets, strides and
  aliasing, so host bytes equal the device pool and NIXL reads host bytes as the peer's
  device layout). Every layer is addressed as raw ``[num_blocks, page_elems]`` rows of
  its storage, so a layout that permutes the dims inside a block (vLLM's LBNHC view)
  copies the same bytes. The engine copies every physical tensor per run of blocks: one
  ``copy_`` per run when the tensors are evenly spaced in one backing buffer (vLLM 0.32.0
  allocates them so), else one per run per physical tensor.
- ``op(src_caches, dst_caches, src_block_ids, dst_block_ids, direction)``: vLLM's
  ``CopyBlocksOp`` signature. vLLM 0.32.0 calls it from ``save_kv_to_host`` (d2h, device
  -> host) and ``sync_recved_kv_to_device`` (h2d) with the worker's two dicts and one
  list twice: the request's groups concatenated, kernel block ids, the null block 0
  padding sliding-window groups. The ids are trusted (vLLM's scheduler allocated them; an
  id out of range still fails in torch's ``narrow``, before that run's copy): they go
  straight to runs (`kvstage.plan.runs_of_ids`: the runs ``GroupedBlockIds(...,
  trusted=True)`` + ``plan_copy`` give, without building either; the per-group split is
  gone by then and planning needs only the id set) and to ``CopyEngine.copy_runs``.
  Different src and dst ids, other dicts or another direction: ``ValueError`` before a
  byte moves (vLLM 0.32.0 never passes them).

Ownership: vLLM owns the device tensors, the host tensors belong to the connector's
host-buffer dict; the op keeps views of both, no copy. Threads: one caller at a time
(vLLM's worker step), as `CopyEngine`. CUDA: ``direct`` copies, non-blocking from pinned
memory, one synchronisation per call (vLLM's host path expects the copy done on return).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvstage.cache import HostBuffer, KVCache, layout_from_layers
from kvstage.engine import CopyEngine, Direction
from kvstage.layout import DTYPES, AttentionSpec, FullAttentionSpec, MLASpec, SlidingWindowSpec
from kvstage.plan import runs_of_ids

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page_elems]`` over the bytes of layer ``t`` (blocks on dim 0, each
    block one dense range whatever the order of the dims inside it)."""
    if t.dim() < 2:
        raise ValueError(f"layer {name!r}: expected [num_blocks, ...], got shape {list(t.shape)}")
    nb = t.shape[0]
    page = t.numel() // nb
    inner = sorted((st, n) for st, n in zip(t.stride()[1:], t.shape[1:], strict=True) if n > 1)
    span = 1
    for st, n in inner:
        if st != span:
            break
        span *= n
    if t.stride(0) != page or span != page:
        raise ValueError(
            f"layer {name!r} (shape {list(t.shape)}, stride {list(t.stride())}) is not "
            "[num_blocks, ...] with each block one dense range; kvstage's connector needs "
            "vLLM's block-first KV layouts"
        )
    return t.as_strided((nb, page), (page, 1))


def _spec(vllm_spec: Any, page_elems: int, dtype: torch.dtype) -> AttentionSpec:
    """A kvstage spec with vLLM's heads and head size whose page is ``page_elems``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"KV cache dtype {dtype} is not one kvstage copies ({sorted(DTYPES)})")
    heads, head = int(vllm_spec.num_kv_heads), int(vllm_spec.head_size)
    mla = "MLA" in type(vllm_spec).__name__
    per_token = head if mla else 2 * heads * head
    if page_elems % per_token:
        raise ValueError(
            f"a block of {page_elems} elements is not a whole number of tokens of "
            f"{per_token} ({type(vllm_spec).__name__}: {heads} heads x {head})"
        )
    block_size = page_elems // per_token
    if mla:
        return MLASpec(block_size=block_size, head_size=head, dtype=name)
    window = getattr(vllm_spec, "sliding_window", None)
    if window:
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=heads, head_size=head,
                                 dtype=name, sliding_window=int(window))
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head,
                             dtype=name)


def kvstage_groups(
    groups: Sequence[tuple[Sequence[str], Any]], device_caches: Mapping[str, torch.Tensor]
) -> list[tuple[list[str], AttentionSpec]]:
    """vLLM's ``(layer_names, kv_cache_spec)`` per group -> kvstage ``(names, spec)``."""
    out = []
    for names, vllm_spec in groups:
        first = device_caches[names[0]]
        out.append((list(names), _spec(vllm_spec, first.numel() // first.shape[0], first.dtype)))
    return out


class EngineCopyOp:
    """vLLM's ``CopyBlocksOp`` for the connector: one `CopyEngine` does both directions."""

    def __init__(
        self,
        device_caches: Mapping[str, torch.Tensor],
        host_caches: Mapping[str, torch.Tensor],
        groups: Sequence[tuple[Sequence[str], AttentionSpec]],
    ) -> None:
        names = [n for g, _ in groups for n in g]
        device = {n: _rows(n, device_caches[n]) for n in names}
        host = {n: _rows(n, host_caches[n]) for n in names}
        for n in names:
            d, h = device_caches[n], host_caches[n]
            if (d.shape, d.stride(), d.dtype) != (h.shape, h.stride(), h.dtype):
                raise ValueError(
                    f"layer {n!r}: device {list(d.shape)} {d.dtype} stride {list(d.stride())}"
                    f", host {list(h.shape)} {h.dtype} stride {list(h.stride())}; build the "
                    "host side with mirror_host_buffers"
                )
        self.layout = layout_from_layers(device, [(list(g), s) for g, s in groups])
        self.engine = CopyEngine(
            KVCache.wrap_layers(self.layout, device),
            HostBuffer.wrap_layers(self.layout, host),
            mode="direct",
        )
        self._device, self._host = device_caches, host_caches

    def __call__(
        self,
        src_caches: Mapping[str, torch.Tensor],
        dst_caches: Mapping[str, torch.Tensor],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        direction: str,
    ) -> None:
        if direction == "d2h":
            how, dev, hst = Direction.D2H, src_caches, dst_caches
        elif direction == "h2d":
            how, dev, hst = Direction.H2D, dst_caches, src_caches
        else:
            raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
        if dev is not self._device or hst is not self._host:
            self._check_caches(dev, hst, direction)
        if src_block_ids is not dst_block_ids and src_block_ids != dst_block_ids:
            raise ValueError(
                "the connector's host buffer mirrors the device block for block: src and "
                f"dst ids must be equal, got {list(src_block_ids)[:8]} and "
                f"{list(dst_block_ids)[:8]}"
            )
        # trusted ids straight to runs, then the engine's direct copies (see runs_of_ids)
        self.engine.copy_runs(runs_of_ids(src_block_ids), how)

    def _check_caches(
        self, dev: Mapping[str, torch.Tensor], hst: Mapping[str, torch.Tensor], direction: str
    ) -> None:
        """Other dict objects are accepted when they hold the same tensors."""
        for mine, theirs, side in ((self._device, dev, "device"), (self._host, hst, "host")):
            for name, t in mine.items():
                other = theirs.get(name)
                if other is None or other.data_ptr() != t.data_ptr() or other.shape != t.shape:
                    raise ValueError(
                        f"{direction}: the {side} caches passed are not the ones this op was "
                        f"built over (layer {name!r}); build one EngineCopyOp per worker"
                    )
