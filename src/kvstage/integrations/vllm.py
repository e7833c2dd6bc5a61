"""A drop-in for vLLM's ``CopyBlocksOp`` (``copy_kv_blocks``) with kvstage's fused copy.

vLLM's NIXL connector calls ``copy_blocks(src_caches, dst_caches, src_ids, dst_ids,
direction)`` with ``{layer_name: tensor}`` dicts in which layers of different KV cache
groups alias one physical tensor. vLLM's own version loops over layer names and copies
every aliasing layer again (gemma-3-1b: 26 layer copies of 4 tensors); this one copies
each distinct storage once, one slice copy per contiguous run of block ids.

No vLLM import: the function only needs torch tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
import torch

from kvstage.blocks import NULL_BLOCK
from kvstage.plan import find_runs

_Key = tuple[int, tuple[int, ...], tuple[int, ...]]


def copy_blocks(
    src_caches: dict[str, torch.Tensor],
    dst_caches: dict[str, torch.Tensor],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    direction: Literal["h2d", "d2h"],
    *,
    block_dim: int = 0,
) -> None:
    """Copy blocks ``src_block_ids[i] -> dst_block_ids[i]`` of every layer.

    Shapes: each value is one layer's cache with the block dimension at ``block_dim``:
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (packed, ``block_dim=0``),
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K/V split, ``block_dim=1``)
    or ``[num_blocks, block_size, head_size]`` (MLA). ``src_caches[k]`` and
    ``dst_caches[k]`` have the same shape and dtype; their ``num_blocks`` bound the ids
    of their side. ``direction`` ``"h2d"``: sources on the CPU; ``"d2h"``: destinations
    on the CPU.

    Layers aliasing one tensor (same data_ptr, shape and stride) are copied once; the
    aliasing must be the same on both sides. Pairs ``(0, 0)`` (null padding) are skipped;
    both id lists empty is a no-op. Everything is validated before a byte moves:
    ``ValueError``/``TypeError`` say what was expected, never a silent return. CUDA copies
    are non-blocking, with one synchronisation at the end.
    """
    pairs = _validate(src_caches, dst_caches, src_block_ids, dst_block_ids, direction, block_dim)
    if pairs is None:
        return
    src_ids, dst_ids = pairs
    runs = find_runs(src_ids, dst_ids).tolist()
    cuda_devices = {
        t.device
        for caches in (src_caches, dst_caches)
        for t in caches.values()
        if t.device.type == "cuda"
    }
    non_blocking = bool(cuda_devices)
    for name in _distinct_keys(src_caches):
        src, dst = src_caches[name], dst_caches[name]
        for s, d, n in runs:
            piece = src.narrow(block_dim, s, n)
            dst.narrow(block_dim, d, n).copy_(piece, non_blocking=non_blocking)
    for device in cuda_devices:
        torch.cuda.synchronize(device)


def _alias_key(t: torch.Tensor) -> _Key:
    return (int(t.data_ptr()), tuple(t.shape), tuple(t.stride()))


def _distinct_keys(caches: Mapping[str, torch.Tensor]) -> list[str]:
    """The first layer name of every distinct (data_ptr, shape, stride), in dict order."""
    seen: dict[_Key, str] = {}
    for name, t in caches.items():
        seen.setdefault(_alias_key(t), name)
    return list(seen.values())


def _alias_classes(caches: Mapping[str, torch.Tensor]) -> set[frozenset[str]]:
    classes: dict[_Key, set[str]] = {}
    for name, t in caches.items():
        classes.setdefault(_alias_key(t), set()).add(name)
    return {frozenset(c) for c in classes.values()}


def _check_ids(side: str, ids: object) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{side}_block_ids must be a list of ints, got {type(ids).__name__}")
    out = []
    for i, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise TypeError(
                f"{side}_block_ids[{i}] must be an int block id, got {type(b).__name__} {b!r}"
            )
        if b < 0:
            raise ValueError(
                f"{side}_block_ids[{i}] is {b}: block ids are >= 0 (0 = null block)"
            )
        out.append(int(b))
    return out


def _validate(
    src_caches: object,
    dst_caches: object,
    src_block_ids: object,
    dst_block_ids: object,
    direction: object,
    block_dim: object,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Every check, in order; returns the (src, dst) ids to copy, or None for nothing."""
    for side, caches in (("src", src_caches), ("dst", dst_caches)):
        if not isinstance(caches, Mapping):
            raise TypeError(
                f"{side}_caches must be a dict {{layer_name: tensor}}, got {type(caches).__name__}"
            )
        if not caches:
            raise ValueError(f"{side}_caches is empty: pass one tensor per layer name")
        for name, t in caches.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{side}_caches[{name!r}] must be a torch.Tensor, got {type(t).__name__}"
                )
    assert isinstance(src_caches, Mapping) and isinstance(dst_caches, Mapping)
    if set(src_caches) != set(dst_caches):
        missing = sorted(set(src_caches) - set(dst_caches))[:4]
        extra = sorted(set(dst_caches) - set(src_caches))[:4]
        raise ValueError(
            "src_caches and dst_caches must have the same layer names; "
            f"missing in dst: {missing}, only in dst: {extra}"
        )
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    if isinstance(block_dim, bool) or not isinstance(block_dim, int) or block_dim < 0:
        raise TypeError(f"block_dim must be an int >= 0 (0 packed, 1 K/V split), got {block_dim!r}")
    src_ids = _check_ids("src", src_block_ids)
    dst_ids = _check_ids("dst", dst_block_ids)
    if len(src_ids) != len(dst_ids):
        raise ValueError(
            f"src_block_ids has {len(src_ids)} ids, dst_block_ids has {len(dst_ids)}; "
            "they pair one to one"
        )
    for name, src in src_caches.items():
        dst = dst_caches[name]
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(
                f"layer {name!r}: src is {tuple(src.shape)} {src.dtype}, dst is "
                f"{tuple(dst.shape)} {dst.dtype}; both sides need one shape and dtype"
            )
        if block_dim >= src.dim():
            raise ValueError(
                f"block_dim {block_dim} is out of range for layer {name!r} of shape "
                f"{tuple(src.shape)}"
            )
    for side, caches, ids in (("src", src_caches, src_ids), ("dst", dst_caches, dst_ids)):
        devices = {t.device for t in caches.values()}
        if len(devices) != 1:
            raise ValueError(f"{side}_caches span devices {sorted(map(str, devices))}; use one")
        num_blocks = min(t.shape[block_dim] for t in caches.values())
        bad = [b for b in ids if b >= num_blocks]
        if bad:
            raise ValueError(
                f"{side}_block_ids has id {bad[0]} out of range: the {side} tensors hold "
                f"{num_blocks} blocks along dim {block_dim}, ids must be in [0, {num_blocks})"
            )
    src_dev = next(iter(src_caches.values())).device
    dst_dev = next(iter(dst_caches.values())).device
    if direction == "h2d" and src_dev.type != "cpu":
        raise ValueError(f"h2d copies from the host: src_caches must be on the CPU, got {src_dev}")
    if direction == "d2h" and dst_dev.type != "cpu":
        raise ValueError(f"d2h copies to the host: dst_caches must be on the CPU, got {dst_dev}")
    for name, t in dst_caches.items():
        # a stride-0 dim (expand()) maps several blocks onto the same bytes: one
        # destination block would silently overwrite another
        if any(st == 0 and size > 1 for st, size in zip(t.stride(), t.shape, strict=True)):
            raise ValueError(
                f"dst_caches[{name!r}] has elements that overlap in memory (stride "
                f"{tuple(t.stride())} for shape {tuple(t.shape)}, e.g. from expand()); "
                "pass a real allocation (.contiguous() or the cache itself)"
            )
    if _alias_classes(src_caches) != _alias_classes(dst_caches):
        raise ValueError(
            "layers that alias one tensor in src_caches must alias one tensor in dst_caches "
            "too (and only those): the host buffer must mirror the device's sharing"
        )
    null = (NULL_BLOCK, NULL_BLOCK)
    kept = [(s, d) for s, d in zip(src_ids, dst_ids, strict=True) if (s, d) != null]
    dsts = [d for _, d in kept]
    if len(set(dsts)) != len(dsts):
        dup = next(d for d in dsts if dsts.count(d) > 1)
        raise ValueError(
            f"dst block {dup} is written more than once; each destination block takes "
            "one source (only the null pair (0, 0) may repeat)"
        )
    if not kept:
        return None
    return (
        np.array([s for s, _ in kept], dtype=np.int64),
        np.array(dsts, dtype=np.int64),
    )
