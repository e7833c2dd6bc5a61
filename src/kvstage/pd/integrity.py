"""End-to-end integrity (opt-in): one 64-bit digest per block, prefill d2h -> decode h2d.

Prefill hashes the host rows of every block it saves (``PrefillWorker(verify_checksum=
True)``, at d2h, after the copy) and sends the digests with the lease (``Lease.checksums``,
also ``PrefillDone.checksums``): one list per group, aligned with the request's block ids.
Decode (``DecodeWorker(verify_checksum=True)``) hashes the host rows it READ, before the
h2d, and compares them pair by pair; a mismatch fails the request with code
``checksum_mismatch`` and nothing reaches the device. Per block rather than per request:
decode may read only a suffix of a group (vLLM's prefix trim), and a per-block digest
names the blocks that differ.

Wire: the CLI's messages carry one digest list per group aligned with the block ids
(`digest_map` reads them); the vLLM connector's ``kv_transfer_params`` carry the JSON form
`to_params` writes and `from_params` reads. Both become remote block id -> digest, checked by
`mismatches` over the pairs `kvstage.pd.reads.pair_blocks` makes, and `describe` words it.

Hash: xxHash3-64 (``xxhash`` package, extra ``integrity``). crc32c was as fast on 2 MiB
rows and slower on small ones (BENCHMARKS.md "What does the checksum cost?"), and 64 bits make an
undetected corruption of a block ~2**-64 instead of 2**-32. The one import of xxhash.

A block is hashed over its bytes in host order: the block-major row (one range), or,
in the mirror host layout, its slice of every tensor and plane in tensor-major order.
Both sides share the layout (checked at handshake), so the same bytes give the same digest.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvstage.cache import HostBuffer

if TYPE_CHECKING:
    from kvstage.pd.tp_copy import HostPart

CHECKSUM = "xxh3_64"
INTEGRITY_MISSING = "checksums need the xxhash package: pip install 'kvstage[integrity]'"


def _xxhash() -> ModuleType:
    try:
        return importlib.import_module("xxhash")
    except ImportError as exc:
        raise ImportError(INTEGRITY_MISSING) from exc


def check_available() -> None:
    """Raise ImportError with the install hint when the hash library is missing."""
    _xxhash()


def _bytes(host: HostBuffer | HostPart) -> torch.Tensor:
    """The storage as uint8: block-major ``[NB, row]``, mirror ``[T * P, NB, plane]``."""
    s = host.storage
    if host.block_major:
        return s.view(s.shape[0], -1).view(torch.uint8)
    t, p, nb, _ = s.shape
    return s.view(t * p, nb, -1).view(torch.uint8)


def block_digests(host: HostBuffer | HostPart, block_ids: Sequence[int]) -> list[int]:
    """xxh3-64 of each block's host bytes, in the order of ``block_ids`` (null -> 0)."""
    xx = _xxhash()
    raw = _bytes(host)
    out = []
    if host.block_major:
        rows = raw.numpy()
        for b in block_ids:
            out.append(xx.xxh3_64_intdigest(memoryview(rows[b])) if b else 0)
        return out
    return _plane_digests(xx, raw.numpy(), block_ids)


def digest_map(remote_ids: Sequence[Sequence[int]],
               checksums: Sequence[Sequence[int]]) -> dict[int, int] | None:
    """Remote block id -> prefill's digest; None when ``checksums`` is not one digest per
    block of ``remote_ids`` (then every block counts as wrong)."""
    if len(checksums) != len(remote_ids) or any(
        len(c) != len(r) for c, r in zip(checksums, remote_ids, strict=True)
    ):
        return None
    return {int(b): int(d) for r, c in zip(remote_ids, checksums, strict=True)
            for b, d in zip(r, c, strict=True) if b}


def to_params(digests: dict[int, int]) -> dict[str, dict[str, str]]:
    """The JSON form of remote block id -> digest (the vLLM connector's
    ``kv_transfer_params``, which routers parse): hex strings keyed by decimal ids."""
    return {CHECKSUM: {str(b): f"{d:016x}" for b, d in digests.items()}}


def from_params(value: Any) -> dict[int, int] | None:
    """`to_params`'s inverse; None when ``value`` is not that shape (it came off the wire)."""
    try:
        return {int(b): int(d, 16) for b, d in value[CHECKSUM].items()}
    except (TypeError, KeyError, ValueError, AttributeError):
        return None


def mismatches(pairs: Sequence[tuple[int, int]], digests: dict[int, int] | None,
               got: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(remote id, local id)`` pairs whose local digest (``got``, aligned with
    ``pairs``) is not prefill's for the remote block; every pair when ``digests`` is None."""
    if digests is None:
        return list(pairs)
    return [(r, loc) for (r, loc), g in zip(pairs, got, strict=True) if digests.get(r) != g]


def run_mismatches(host: HostBuffer | HostPart, runs: np.ndarray,
                   digests: dict[int, int] | None) -> list[tuple[int, int]]:
    """``(remote id, local id)`` of every block of ``runs`` ([R, 3] remote start, local
    start, n) whose local host bytes do not hash to prefill's digest."""
    src = np.concatenate([np.arange(s, s + n) for s, _, n in runs.tolist()]).tolist()
    dst = np.concatenate([np.arange(d, d + n) for _, d, n in runs.tolist()]).tolist()
    pairs = list(zip(src, dst, strict=True))
    return mismatches(pairs, digests, [] if digests is None else block_digests(host, dst))


def describe(bad: list[tuple[int, int]], num_blocks: int, *,
             prefix: str = "checksum mismatch: ") -> str:
    """One line for people: how many blocks differ and the first few."""
    shown = ", ".join(f"remote {r} -> local {loc}" for r, loc in bad[:4])
    return (
        f"{prefix}{len(bad)} of {num_blocks} blocks differ after the READ "
        f"({shown}{', ...' if len(bad) > 4 else ''}); nothing of them was loaded to the "
        "device"
    )


def views_digests(views: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[int]:
    """xxh3-64 of each block over per-tensor ``[P, NB, E]`` host views (a `HostBuffer`'s
    ``tensor_views``, also when its tensors form no slab), in tensor-major, plane order:
    the digest `block_digests` gives for a mirror-layout buffer (null -> 0)."""
    xx = _xxhash()
    planes = [p.numpy() for v in views for p in v.reshape(v.shape[0], v.shape[1], -1)
              .view(torch.uint8).unbind(0)]
    return _plane_digests(xx, planes, block_ids)


#: (physical tensor, first byte, end byte) of a block's row in that tensor, planes in order
Extent = tuple[int, int, int]


def extent_digests(views: Sequence[torch.Tensor], extents: Sequence[Extent],
                   block_ids: Sequence[int]) -> list[int]:
    """xxh3-64 of each block over only ``extents`` of its rows (null -> 0): what a READ that
    writes part of a page (a state layer's states, not its padding; the tensors a group
    has layers in) wrote, so bytes it never touches cannot make honest blocks differ."""
    xx = _xxhash()
    tensors = [[p.numpy() for p in v.reshape(v.shape[0], v.shape[1], -1).view(torch.uint8)
                .unbind(0)] for v in views]
    out = []
    for b in block_ids:
        if not b:
            out.append(0)
            continue
        h = xx.xxh3_64()
        for t, start, stop in extents:
            at = 0
            for plane in tensors[t]:
                row = plane[b]
                lo, hi = max(start - at, 0), min(stop - at, row.shape[0])
                if lo < hi:
                    h.update(memoryview(row[lo:hi]))
                at += row.shape[0]
        out.append(h.intdigest())
    return out


def _plane_digests(xx: Any, planes: Any, block_ids: Sequence[int]) -> list[int]:
    """xxh3-64 of each block's rows over every plane, in order (the null block -> 0)."""
    out = []
    for b in block_ids:
        if not b:
            out.append(0)
            continue
        h = xx.xxh3_64()
        for plane in planes:
            h.update(memoryview(plane[b]))
        out.append(h.intdigest())
    return out
