"""vLLM's ``CopyBlocksOp``: the bytes of vLLM's ``copy_kv_blocks``, with fewer copies.

Contract
--------
Primitive: ``copy_blocks(src_caches, dst_caches, src_block_ids, dst_block_ids, direction,
*, block_dim=0)``, the op vLLM's NIXL connector installs with ``set_host_xfer_buffer_ops``.
Its result is byte-identical to vLLM's op with the CUDA platform's bodies: for every layer
name in ``src_caches`` order, ``dst[dst_ids] = src[src_ids]`` along ``block_dim`` (the
whole gather first, then the scatter; a destination id given twice keeps its last pair,
which is what vLLM's op gives on the CPU with one thread; with several, torch leaves the
winner of a repeated ``index_put_`` destination unspecified).

Shapes: ``{layer_name: tensor}`` with the blocks on ``block_dim``. vLLM 0.32.0:
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` views of one int8 backing
buffer, contiguous (LBHNC) or a permutation of ``[num_blocks, block_size, num_kv_heads,
2 * head_size]`` (LBNHC); other backends: ``[num_blocks, 2, ...]`` (block_dim 0),
``[2, num_blocks, ...]`` (block_dim 1), MLA ``[num_blocks, block_size, head_size]``. A
layer's src and dst share dtype and the dims other than ``block_dim`` (size 1 on the src
side broadcasts, as in vLLM); ``num_blocks`` may differ. On the device, layers of different
KV cache groups alias a few tensors; vLLM's host buffers are one tensor per layer name.

Ownership: the caller owns every tensor. This module allocates index tensors, and
temporaries only on the loop path below; it keeps no tensor, only a small cache of the
analysis of a pair of dicts, keyed by devices, addresses, dtypes, shapes and strides.

How: layer tensors with one (device, address, dtype, shape, stride) are one *view*.
- Disjoint path (no destination view shares a byte with a source view or with another
  destination view): every distinct destination view is written once per run of
  consecutive (src, dst) ids, from the source of the last layer name that writes it
  (the one vLLM's loop leaves). d2h into per-layer-name host buffers: one copy per host
  buffer per run; h2d into aliased device views: one copy per device view per run.
- Loop path (a destination shares bytes with a source, e.g. ``src_caches is
  dst_caches``, or partially with another destination, or the src side broadcasts):
  vLLM's own per-layer gather and scatter, in its order; only that order gives its bytes.

Refused before a byte moves, ``ValueError``/``TypeError`` saying what was expected, what
arrived and how to fix it: whatever vLLM's op would fail on part way (missing layer names,
ids out of range, dtypes or shapes that do not fit, a destination with stride 0), and, on
purpose, three inputs it returns on or wraps silently: empty dicts, id lists of different
lengths, negative ids. Both id lists empty is a no-op, as in vLLM.

CUDA (a tensor with ``device.type == "cuda"``): non-blocking copies and one
synchronisation at the end; the loop path stages d2h layers through blocking ``.to()``
as vLLM does, and h2d layers through pinned host memory. No vLLM import.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from kvstage.plan import find_runs

# (device type, device index, address, dtype, shape, stride): equal keys = one view
_Key = tuple[str, int, int, torch.dtype, tuple[int, ...], tuple[int, ...]]
_MAX_INTERVALS = 1 << 20  # a view cut into more byte intervals is assumed to overlap
_INT_TYPES = {int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32}


@dataclass(frozen=True)
class _Analysis:
    loop: bool  # the loop path; else the disjoint path
    writers: tuple[int, ...]  # disjoint path: per destination view, its last layer
    src_blocks: int  # ids must be below these on each side
    dst_blocks: int
    cuda: tuple[torch.device, ...]  # synchronised once at the end


def copy_blocks(
    src_caches: dict[str, torch.Tensor],
    dst_caches: dict[str, torch.Tensor],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    direction: Literal["h2d", "d2h"],
    *,
    block_dim: int = 0,
) -> None:
    """Copy blocks ``src_block_ids[i] -> dst_block_ids[i]`` of every layer, with the
    bytes of vLLM's ``copy_kv_blocks`` (see the module docstring for the contract).

    Shapes: e.g. ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (vLLM 0.32.0),
    ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (``block_dim=0``),
    ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (``block_dim=1``).
    ``direction`` ``"h2d"``: sources on the CPU; ``"d2h"``: destinations on the CPU.
    """
    layers = _check_caches(src_caches, dst_caches)
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    if isinstance(block_dim, bool) or not isinstance(block_dim, int) or block_dim < 0:
        raise TypeError(
            f"block_dim must be an int >= 0 (0: blocks first, 1: [2, num_blocks, ...]), "
            f"got {block_dim!r}"
        )
    src_ids = _check_ids("src", src_block_ids)
    dst_ids = _check_ids("dst", dst_block_ids)
    if len(src_ids) != len(dst_ids):
        raise ValueError(
            f"src_block_ids has {len(src_ids)} ids, dst_block_ids has {len(dst_ids)}; "
            "they pair one to one (vLLM's op would silently copy nothing)"
        )
    keys = tuple((name, _key(s), _key(d)) for name, s, d in layers)
    plan = _analyse(keys, direction, block_dim)
    for side, ids, bound in (("src", src_ids, plan.src_blocks), ("dst", dst_ids, plan.dst_blocks)):
        if ids.size and ids.max() >= bound:
            raise ValueError(
                f"{side}_block_ids has id {ids[ids >= bound][0]} out of range: the {side} "
                f"tensors hold {bound} blocks along dim {block_dim}, ids must be in [0, {bound})"
            )
    if not src_ids.size:
        return
    src, dst = _last_pairs(src_ids, dst_ids)
    if plan.loop:
        _loop(layers, src, dst, block_dim)
    else:
        runs = find_runs(src, dst).tolist()  # dst is sorted: the plan's run-finding as is
        for i in plan.writers:
            _, s_t, d_t = layers[i]
            for s, d, n in runs:
                piece = s_t.narrow(block_dim, s, n)
                d_t.narrow(block_dim, d, n).copy_(piece, non_blocking=bool(plan.cuda))
    for device in plan.cuda:
        torch.cuda.synchronize(device)


# -- validation -----------------------------------------------------------------------


def _check_caches(
    src_caches: object, dst_caches: object
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, src, dst)`` in ``src_caches`` order (vLLM's loop order)."""
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
    missing = [name for name in src_caches if name not in dst_caches]
    if missing:
        raise ValueError(
            "src_caches and dst_caches must have the same layer names; "
            f"missing in dst: {missing[:4]}, only in dst: "
            f"{[n for n in dst_caches if n not in src_caches][:4]}"
        )
    return [(name, t, dst_caches[name]) for name, t in src_caches.items()]


def _check_ids(side: str, ids: object) -> np.ndarray:
    """int64 ``[n]``: ints (Python or numpy, never bools), 0 <= id < 2**63."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{side}_block_ids must be a list of ints, got {type(ids).__name__}")
    if not set(map(type, ids)) <= _INT_TYPES:  # the first id of another type, for the message
        for i, b in enumerate(ids):
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
                raise TypeError(
                    f"{side}_block_ids[{i}] must be an int block id, got {type(b).__name__} {b!r}"
                )
        ids = [int(b) for b in ids]  # int subclasses, numpy uint64
    try:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    except OverflowError:
        raise ValueError(f"{side}_block_ids has an id beyond int64: block ids are small") from None
    if arr.size and arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(
            f"{side}_block_ids[{i}] is {arr[i]}: block ids are >= 0 (0 = null block); "
            "vLLM's op would wrap it around to the last blocks"
        )
    return arr


def _key(t: torch.Tensor) -> _Key:
    dev = t.device
    return (
        dev.type,
        -1 if dev.index is None else dev.index,
        t.data_ptr(),
        t.dtype,
        tuple(t.shape),
        tuple(t.stride()),
    )


@functools.lru_cache(maxsize=64)
def _analyse(
    layers: tuple[tuple[str, _Key, _Key], ...], direction: str, block_dim: int
) -> _Analysis:
    """Every check that depends on the dicts only, and the path to take."""
    for side, keys in (("src", [k for _, k, _ in layers]), ("dst", [k for _, _, k in layers])):
        devices = sorted({k[0] if k[1] < 0 else f"{k[0]}:{k[1]}" for k in keys})
        if len(devices) != 1:
            raise ValueError(f"{side}_caches span devices {devices}; use one")
    src_dev, dst_dev = layers[0][1][0], layers[0][2][0]
    if direction == "h2d" and src_dev != "cpu":
        raise ValueError(f"h2d copies from the host: src_caches must be on the CPU, got {src_dev}")
    if direction == "d2h" and dst_dev != "cpu":
        raise ValueError(f"d2h copies to the host: dst_caches must be on the CPU, got {dst_dev}")
    for side, dev in (("src", src_dev), ("dst", dst_dev)):
        if dev == "meta":
            raise ValueError(f"{side}_caches are on the meta device: they hold no bytes to copy")
    broadcast = False
    for name, sk, dk in layers:
        s_shape, d_shape = sk[4], dk[4]
        if sk[3] != dk[3] or len(s_shape) != len(d_shape):
            raise ValueError(
                f"layer {name!r}: src is {s_shape} {sk[3]}, dst is {d_shape} {dk[3]}; "
                "both sides need one shape and dtype (num_blocks may differ)"
            )
        if block_dim >= len(s_shape):
            raise ValueError(
                f"block_dim {block_dim} is out of range for layer {name!r} of shape {s_shape}"
            )
        for k, (a, b) in enumerate(zip(s_shape, d_shape, strict=True)):
            if k != block_dim and a != b:
                if a != 1:
                    raise ValueError(
                        f"layer {name!r}: src is {s_shape}, dst is {d_shape}; both sides need "
                        f"one shape and dtype (they may differ in dim {block_dim}, the blocks)"
                    )
                broadcast = True
        if any(st == 0 and n > 1 for n, st in zip(d_shape, dk[5], strict=True)):
            raise ValueError(
                f"dst_caches[{name!r}] has elements that overlap in memory (stride {dk[5]} "
                f"for shape {d_shape}, e.g. from expand()); pass a real allocation "
                "(.contiguous() or the cache itself)"
            )
    src_blocks = min(sk[4][block_dim] for _, sk, _ in layers)
    dst_blocks = min(dk[4][block_dim] for _, _, dk in layers)
    views = {k: i for i, k in enumerate(dict.fromkeys(k for _, sk, dk in layers for k in (sk, dk)))}
    dst_views = {views[dk] for _, _, dk in layers}
    src_views = {views[sk] for _, sk, _ in layers}
    loop = broadcast or bool(dst_views & src_views) or _bytes_shared(list(views), dst_views)
    last: dict[int, int] = {}
    for i, (_, _, dk) in enumerate(layers):
        last[views[dk]] = i
    cuda = tuple(
        {torch.device(k[0], k[1]) for _, sk, dk in layers for k in (sk, dk) if k[0] == "cuda"}
    )
    return _Analysis(loop, tuple(last.values()), src_blocks, dst_blocks, cuda)


# -- memory overlap -------------------------------------------------------------------


def _extent(k: _Key) -> tuple[int, int]:
    """[first byte, last byte + 1) of a view; (0, 0) when it has no element."""
    shape, stride, item = k[4], k[5], k[3].itemsize
    if 0 in shape:
        return (0, 0)
    last = sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
    return (k[2], k[2] + (last + 1) * item)


def _intervals(k: _Key) -> tuple[np.ndarray, np.ndarray] | None:
    """The view's bytes as [start, end) intervals, or None when there are too many."""
    item = k[3].itemsize
    dims = sorted((st * item, n) for n, st in zip(k[4], k[5], strict=True) if n > 1)
    run, j = item, 0
    while j < len(dims) and dims[j][0] == run:  # dims that continue a contiguous run
        run *= dims[j][1]
        j += 1
    if math.prod(n for _, n in dims[j:]) > _MAX_INTERVALS:
        return None
    offsets = np.zeros(1, dtype=np.int64)
    for st, n in dims[j:]:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
    starts = k[2] + offsets
    return starts, starts + run


def _injective(k: _Key) -> bool:
    """Sufficient: every stride steps over all inner dims (no two elements share a byte)."""
    item = k[3].itemsize
    span = item
    for st, n in sorted((st * item, n) for n, st in zip(k[4], k[5], strict=True) if n > 1):
        if st < span:
            return False
        span += st * (n - 1)
    return True


def _intervals_meet(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    starts = np.concatenate((a[0], b[0]))
    ends = np.concatenate((a[1], b[1]))
    side = np.concatenate((np.zeros(a[0].size, bool), np.ones(b[0].size, bool)))
    order = np.argsort(starts, kind="stable")
    starts, ends, side = starts[order], ends[order], side[order]
    for mine in (False, True):  # does an interval start inside an earlier one of the other?
        prev = np.maximum.accumulate(np.where(side == mine, ends, np.iinfo(np.int64).min))
        if np.any((side != mine)[1:] & (starts[1:] < prev[:-1])):
            return True
    return False


def _self_overlaps(k: _Key) -> bool:
    if _injective(k):
        return False
    iv = _intervals(k)
    if iv is None:
        return True
    order = np.argsort(iv[0], kind="stable")
    starts, ends = iv[0][order], iv[1][order]
    return bool(np.any(starts[1:] < np.maximum.accumulate(ends)[:-1]))


def _bytes_shared(views: list[_Key], dst_views: set[int]) -> bool:
    """Does a destination view share a byte with another view (or with itself)?"""
    if any(_self_overlaps(views[i]) for i in dst_views):
        return True
    spans = sorted((k[0], k[1], *_extent(k), i) for i, k in enumerate(views) if _extent(k)[1] > 0)
    for a, (dev, idx, _, end, i) in enumerate(spans):
        for dev2, idx2, start2, _, j in spans[a + 1 :]:
            if (dev2, idx2) != (dev, idx) or start2 >= end:
                break
            if i not in dst_views and j not in dst_views:
                continue  # two sources may overlap: nothing writes them
            iv_i, iv_j = _intervals(views[i]), _intervals(views[j])
            if iv_i is None or iv_j is None or _intervals_meet(iv_i, iv_j):
                return True
    return False


# -- copies ---------------------------------------------------------------------------


def _last_pairs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs whose destination is not given again later, in dst order."""
    _, first_from_end = np.unique(dst[::-1], return_index=True)
    keep = dst.size - 1 - first_from_end
    return src[keep], dst[keep]


def _loop(
    layers: list[tuple[str, torch.Tensor, torch.Tensor]],
    src: np.ndarray,
    dst: np.ndarray,
    block_dim: int,
) -> None:
    """vLLM's loop: per layer name, gather then scatter (advanced indexing, so a
    size-1 source dim broadcasts as in vLLM); a destination may feed a later layer."""
    lead = (slice(None),) * block_dim
    s_dev, d_dev = layers[0][1].device, layers[0][2].device
    s_idx = torch.from_numpy(src).to(s_dev)
    d_idx = torch.from_numpy(dst).to(d_dev)
    s_at: tuple[slice | torch.Tensor, ...] = (*lead, s_idx)
    d_at: tuple[slice | torch.Tensor, ...] = (*lead, d_idx)
    for _, s_t, d_t in layers:
        if s_dev.type == "cpu" and d_dev.type == "cuda":
            shape = list(s_t.shape)
            shape[block_dim] = src.size
            staged = torch.empty(shape, dtype=s_t.dtype, pin_memory=True)
            torch.index_select(s_t, block_dim, s_idx, out=staged)
            value = staged.to(d_dev, non_blocking=True)
        else:
            value = s_t[s_at].to(d_dev)
        d_t[d_at] = value
