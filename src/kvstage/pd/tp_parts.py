"""A rank's page cut into parts, for prefill and decode at different tensor-parallel sizes.

Contract
--------
A page (one block of one physical tensor, ``page_bytes``) holds this rank's shard of every
field of its group: attention heads, a state's x / B / C / SSM heads. Across TP sizes
(`kvstage.pd.tp_map`) a prefill page is read as S *slices* and a decode page is assembled
from R *regions*, each part holding the units ``[p*u/K, (p+1)*u/K)`` of every field of
``u`` units (K = S or R).

`page_parts(unit_maps, fields, num_parts, page_bytes)` cuts one page: per group the byte
*segments* ``(page offset, part offset, nbytes)`` of each part (runs of bytes, in page
order, whose unit falls in the part; padding belongs to none), and the part's *signature*
(each field's name, units per part and bytes per unit, in page order, plus the part's row
bytes): a prefill slice and a decode region hold the same bytes in the same order exactly
when their signatures are equal (`PageParts.signature`, compared at handshake). A part is
stored as its segments one after the other from offset 0 of a ``page_bytes / K`` row:
the host buffer, the same bytes as the device pool, is read as ``[K, NB, T, page/K]``
(`kvstage.pd.tp_copy`). One descriptor then covers a run of blocks of a part, every
tensor at once.

Unit maps (per byte of the page: the field index and the unit within the field, -1 for
padding) come from `head_units` (an attention layer's tensor: heads from its shape and
strides, any order of the dims inside a block) and `state_units` (a Mamba2 or gated delta
net page from kvstage's `MambaSpec`, either conv layout). Pure numpy; frozen results.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstage.errors import LayoutMismatch
from kvstage.specs import DTYPES, MambaSpec

__all__ = [
    "GroupParts", "PageParts", "TPSide", "head_units", "page_parts", "state_fields",
    "state_units",
]

#: a field of a page: (name, units on this rank)
Field = tuple[str, int]
#: per byte of a page: (field index, unit index), -1 where no field lives (padding)
UnitMap = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class GroupParts:
    """One group's page cut into K parts: ``segments[p]`` = ((page offset, part offset,
    nbytes), ...) of part p; ``signature``: ((field, units per part, bytes per unit), ...)."""

    segments: tuple[tuple[tuple[int, int, int], ...], ...]
    signature: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class PageParts:
    """Every group's page (``page_bytes`` per tensor of ``num_tensors``) cut into
    ``num_parts`` parts of ``part_bytes`` each."""

    num_parts: int
    page_bytes: int
    num_tensors: int
    groups: tuple[GroupParts, ...]

    @property
    def part_bytes(self) -> int:
        return self.page_bytes // self.num_parts

    @property
    def row_bytes(self) -> int:
        """A part of one block over every tensor: what one READ row moves."""
        return self.num_tensors * self.part_bytes

    def signature(self) -> str:
        """What a slice of the other side must equal, as compact JSON (the handshake's)."""
        return json.dumps([self.num_tensors, self.part_bytes,
                           [list(map(list, g.signature)) for g in self.groups]],
                          separators=(",", ":"))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of True in ``mask``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _cut(units: UnitMap, fields: Sequence[Field], num_parts: int, page_bytes: int,
         what: str) -> GroupParts:
    field_of, unit_of = units
    for name, count in fields:
        if count % num_parts:
            raise LayoutMismatch(
                f"{what}: field {name!r} holds {count} units per rank, which do not split "
                f"into {num_parts} equal parts; serve prefill and decode at TP sizes it "
                "divides"
            )
    part_bytes = page_bytes // num_parts
    per_unit = [int(np.count_nonzero(field_of == f)) // count
                for f, (_, count) in enumerate(fields)]
    order = [int(f) for f in dict.fromkeys(field_of[field_of >= 0].tolist())]
    signature = tuple((fields[f][0], fields[f][1] // num_parts, per_unit[f]) for f in order)
    segments = []
    for p in range(num_parts):
        size = np.array([c // num_parts for _, c in fields], np.int64)
        lo = np.where(field_of >= 0, size[field_of] * p, 0)
        mask = (field_of >= 0) & (unit_of >= lo) & (unit_of < lo + size[field_of])
        at, part = 0, []
        for start, n in _runs(mask):
            part.append((start, at, n))
            at += n
        if at > part_bytes:
            raise LayoutMismatch(f"{what}: part {p} holds {at} B, more than a {num_parts}th "
                                 f"of the {page_bytes} B page")
        segments.append(tuple(part))
    return GroupParts(segments=tuple(segments), signature=signature)


def page_parts(unit_maps: Sequence[tuple[UnitMap, Sequence[Field]]], num_parts: int,
               page_bytes: int, num_tensors: int, *, model: str = "") -> PageParts:
    """Cut every group's page (``unit_maps``: per group its unit map and fields) into
    ``num_parts`` parts (LayoutMismatch in one line where a field does not split)."""
    if num_parts <= 0 or page_bytes % num_parts:
        raise LayoutMismatch(f"a page of {page_bytes} B does not cut into {num_parts} parts")
    of_model = f" of {model!r}" if model else ""
    groups = tuple(_cut(units, fields, num_parts, page_bytes, f"group {g}{of_model}")
                   for g, (units, fields) in enumerate(unit_maps))
    return PageParts(num_parts=num_parts, page_bytes=page_bytes, num_tensors=num_tensors,
                     groups=groups)


def head_units(shape: Sequence[int], stride: Sequence[int], item: int, page_bytes: int,
               num_heads: int, head_dim: int = 1) -> UnitMap:
    """An attention page's unit map from its layer tensor's kernel-block ``shape`` and
    element ``stride`` (``head_dim``: the dim that counts heads, vLLM's ``[blocks, heads,
    tokens, 2 x head size]`` view in any stride order; ``shape[0] / num_blocks`` kernel
    blocks per page are given by ``page_bytes``). Field 0 ("heads"); every byte is a head's."""
    if len(shape) < 2 or shape[head_dim] != num_heads:
        raise LayoutMismatch(
            f"an attention layer of shape {list(shape)} has no dim of {num_heads} heads at "
            f"{head_dim}: kvstage splits heads of vLLM's [blocks, heads, tokens, 2 x head] "
            "views only"
        )
    kernel = page_bytes // (item * stride[0])  # kernel blocks per page
    if kernel < 1 or kernel * stride[0] * item != page_bytes:
        raise LayoutMismatch(f"an attention layer of stride {list(stride)} does not tile its "
                             f"{page_bytes} B page")
    dims = [kernel, *shape[1:]]
    strides = [stride[0], *stride[1:]]
    pos = np.zeros(dims, np.int64)
    heads = np.zeros(dims, np.int64)
    for d, (n, s) in enumerate(zip(dims, strides, strict=True)):
        axis = np.arange(n, dtype=np.int64).reshape([n if i == d else 1 for i in range(len(dims))])
        pos = pos + axis * s
        if d == head_dim:
            heads = heads + axis
    field_of = np.full(page_bytes // item, -1, np.int64)
    unit_of = np.full(page_bytes // item, -1, np.int64)
    flat = pos.reshape(-1)
    if flat.max() >= field_of.size or np.unique(flat).size != flat.size:
        raise LayoutMismatch(f"an attention layer of shape {list(shape)} and stride "
                             f"{list(stride)} does not tile its {page_bytes} B page")
    field_of[flat] = 0
    unit_of[flat] = heads.reshape(-1)
    return np.repeat(field_of, item), np.repeat(unit_of, item)


def state_fields(spec: MambaSpec) -> tuple[list[tuple[str, int]], list[int]]:
    """([(field, units per rank)], [rows per unit]) of the conv state's rows, then the
    recurrent state's heads: Mamba2 x (heads) / B / C (groups), gated delta net q / k (key
    heads) / v (value heads)."""
    if len(spec.shapes) != 2 or len(spec.shapes[0]) != 2 or len(spec.shapes[1]) != 3:
        raise LayoutMismatch(f"a {spec.mamba_type} state of shapes {spec.shapes} is not "
                             "(conv, recurrent): kvstage does not split it across TP sizes")
    conv, (heads, a, b) = spec.shapes
    rows = conv[0] if spec.conv_layout == "DS" else conv[1]
    # Mamba2: recurrent (heads, head_dim a, state b), conv rows x (heads x a), B, C
    # (groups x b); gated delta net: recurrent (v heads, v_dim a, k_dim b), conv rows q, k
    # (k heads x b), v (v heads x a)
    x_rows, unit = heads * a, b
    if spec.mamba_type not in ("mamba2", "gdn_attention"):
        raise LayoutMismatch(f"{spec.mamba_type} state is not split across TP sizes by "
                             "kvstage (Mamba2 and gated delta net are)")
    rest = rows - x_rows
    if rest <= 0 or rest % (2 * unit):
        raise LayoutMismatch(f"a {spec.mamba_type} conv state of {rows} rows does not hold "
                             f"{x_rows} rows for {heads} heads and two parts of {unit}-row "
                             "units")
    groups = rest // (2 * unit)
    if spec.mamba_type == "mamba2":
        return ([("x", heads), ("B", groups), ("C", groups), ("ssm_heads", heads)],
                [a, unit, unit, 1])
    return ([("q", groups), ("k", groups), ("v", heads), ("state_heads", heads)],
            [unit, unit, a, 1])


def state_units(spec: MambaSpec, page_bytes: int) -> tuple[UnitMap, list[Field]]:
    """A state page's unit map and fields (module doc): the conv state's rows by field
    (x / B / C, or q / k / v), then the recurrent state by head; the rest is padding."""
    fields, rows_per_unit = state_fields(spec)
    conv_shape, rec_shape = spec.shapes
    conv_item, rec_item = (DTYPES[d].itemsize for d in spec.dtypes)
    conv_off, rec_off = spec.state_offsets()
    field_of = np.full(page_bytes, -1, np.int64)
    unit_of = np.full(page_bytes, -1, np.int64)
    row_field = np.concatenate([
        np.full(n * r, f, np.int64)
        for f, ((_, n), r) in enumerate(zip(fields[:3], rows_per_unit[:3], strict=True))])
    row_unit = np.concatenate([np.arange(n * r, dtype=np.int64) // r
                               for (_, n), r in zip(fields[:3], rows_per_unit[:3], strict=True)])
    if spec.conv_layout == "DS":  # (rows, width): a row is contiguous
        width = conv_shape[1]
        fo, uo = np.repeat(row_field, width), np.repeat(row_unit, width)
    else:  # SD (width, rows)
        width = conv_shape[0]
        fo, uo = np.tile(row_field, width), np.tile(row_unit, width)
    n = fo.size * conv_item
    field_of[conv_off:conv_off + n] = np.repeat(fo, conv_item)
    unit_of[conv_off:conv_off + n] = np.repeat(uo, conv_item)
    per_head = math.prod(rec_shape[1:]) * rec_item
    n = rec_shape[0] * per_head
    field_of[rec_off:rec_off + n] = 3
    unit_of[rec_off:rec_off + n] = np.repeat(np.arange(rec_shape[0], dtype=np.int64), per_head)
    return (field_of, unit_of), fields


@dataclass(frozen=True)
class TPSide:
    """A rank across TP sizes: its TP ``size`` and ``rank``, the other side's TP size, and
    its pages cut into ``parts`` (the prefill's S slices or the decode's R regions)."""

    size: int
    rank: int
    peer_size: int
    parts: PageParts
