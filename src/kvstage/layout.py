"""KV cache layout: attention and state specs, KV cache groups, physical tensors.

A hybrid model's layers are bucketed by spec and cut into KV cache groups (vLLM's
rule, `group_layers`). Physical tensor i is shared by layer i of every group that has
one, so layers of different groups alias one allocation and use different block ids in
it. Every tensor is described canonically as ``[num_planes, num_blocks, plane_elems]``
and a whole cache as ``[num_tensors, num_planes, num_blocks, plane_elems]``:

- ``CacheLayout.PACKED`` (block dim 0): one plane per tensor; a layer's view is
  ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (MLA:
  ``[num_blocks, block_size, head_size]``).
- ``CacheLayout.KV_SPLIT`` (block dim 1): K and V planes; a layer's view is
  ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

State groups (`MambaSpec`: Mamba1/2, gated delta net, short conv, linear attention) hold a
request's running recurrent state, not a page per token: one block (plus speculative
scratch slots) whatever the prompt length. A state block is an opaque page (conv state then
SSM state, each ``shapes[i]`` of ``dtypes[i]``, padded to the attention page as vLLM
unifies page sizes), so its layer view is ``[num_blocks, page_elems]``. A pool whose groups
have different dtypes (bf16 attention + fp32 SSM state) is addressed in bytes
(`KVLayout.storage_dtype` uint8): the copies move bytes, never values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

import torch

from kvstage.specs import (  # noqa: F401  (re-exported: kvstage.layout is the public home)
    CONV_LAYOUTS,
    DTYPES,
    MAMBA_TYPES,
    AttentionSpec,
    FullAttentionSpec,
    KVSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
    _require_positive,
    cdiv,
    dtype_name,
)


class CacheLayout(enum.Enum):
    """How one physical tensor is shaped on the device."""

    PACKED = "packed"
    KV_SPLIT = "kv_split"

    @property
    def block_dim(self) -> int:
        return 0 if self is CacheLayout.PACKED else 1


@dataclass(frozen=True, kw_only=True)
class KVGroup:
    """Layers that share one block table (and one spec)."""

    group_id: int
    layer_names: tuple[str, ...]
    spec: KVSpec

    def __post_init__(self) -> None:
        if not isinstance(self.spec, AttentionSpec | MambaSpec):
            raise TypeError(
                f"KVGroup {self.group_id}: kvstage does not handle {type(self.spec).__name__} "
                "layers; a group's spec is one of FullAttentionSpec, SlidingWindowSpec, "
                "MLASpec, MambaSpec"
            )
        if not self.layer_names:
            raise ValueError(f"KVGroup {self.group_id} has no layers; every group needs >= 1")


@dataclass(frozen=True, kw_only=True)
class PhysicalTensor:
    """One device allocation, shared by layer ``tensor_id`` of every group that has one."""

    tensor_id: int
    layer_names: tuple[str, ...]
    group_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """The whole KV pool: ``num_blocks`` blocks of every physical tensor, and its groups.

    Hashable and comparable with ``==``; prefill and decode check compatibility with
    `check_compatible` before any byte moves.
    """

    num_blocks: int
    groups: tuple[KVGroup, ...]
    cache_layout: CacheLayout = CacheLayout.PACKED
    name: str = ""
    tensors: tuple[PhysicalTensor, ...] = field(init=False, compare=False, repr=False)
    #: layers per group, in group order (derived; the planner weighs owned slots by it)
    layers_per_group: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        _require_positive("KVLayout", num_blocks=self.num_blocks)
        if self.num_blocks < 2:
            raise ValueError(
                f"KVLayout.num_blocks must be >= 2 (block 0 is the null block), "
                f"got {self.num_blocks}"
            )
        if not self.groups:
            raise ValueError("KVLayout needs at least one KVGroup, got none")
        for index, group in enumerate(self.groups):
            if group.group_id != index:
                raise ValueError(
                    f"KVLayout.groups[{index}].group_id is {group.group_id}; "
                    f"groups must be numbered 0..{len(self.groups) - 1} in order"
                )
        names = [name for g in self.groups for name in g.layer_names]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"layer {dup!r} appears in more than one group (or twice)")
        first = self.groups[0].spec
        for group in self.groups[1:]:
            spec = group.spec
            if spec.page_size_bytes != first.page_size_bytes:
                raise ValueError(
                    f"group {group.group_id} has page {spec.page_size_bytes} B, group 0 has "
                    f"{first.page_size_bytes} B: groups sharing physical tensors need one "
                    "page size (scale attention block sizes, pad state pages, as vLLM does)"
                )
        if self.cache_layout is CacheLayout.KV_SPLIT and any(
            g.spec.num_kv_planes != 2 for g in self.groups
        ):
            raise ValueError(
                "CacheLayout.KV_SPLIT needs K and V planes in every group; MLA latents and "
                "state pages have one plane: use CacheLayout.PACKED"
            )
        if self.page_size_bytes % DTYPES[self.storage_dtype].itemsize:
            raise ValueError(
                f"page of {self.page_size_bytes} B is not a whole number of "
                f"{self.storage_dtype} elements"
            )
        num_tensors = max(len(g.layer_names) for g in self.groups)
        tensors = tuple(
            PhysicalTensor(
                tensor_id=t,
                layer_names=tuple(g.layer_names[t] for g in self.groups if t < len(g.layer_names)),
                group_ids=tuple(g.group_id for g in self.groups if t < len(g.layer_names)),
            )
            for t in range(num_tensors)
        )
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(
            self, "layers_per_group", tuple(len(g.layer_names) for g in self.groups)
        )

    # -- derived sizes --------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_names) for g in self.groups)

    @property
    def spec(self) -> KVSpec:
        return self.groups[0].spec

    @property
    def storage_dtype(self) -> str:
        """`storage_dtype` of the groups' specs."""
        return storage_dtype(g.spec for g in self.groups)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.storage_dtype]

    @property
    def dtype_bytes(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def token_spec(self) -> AttentionSpec | None:
        """The first attention group's spec (None for a pool of state groups only)."""
        return next((g.spec for g in self.groups if isinstance(g.spec, AttentionSpec)), None)

    @property
    def block_size(self) -> int:
        """Tokens per block of the attention groups (state slots do not count tokens)."""
        spec = self.token_spec
        return (spec or self.spec).block_size

    @property
    def has_state(self) -> bool:
        return any(isinstance(g.spec, MambaSpec) for g in self.groups)

    @property
    def page_size_bytes(self) -> int:
        return self.spec.page_size_bytes

    @property
    def num_planes(self) -> int:
        """Planes of a tensor's canonical view: 1 (K and V packed per block) or 2 (K/V split)."""
        return 1 if self.cache_layout is CacheLayout.PACKED else 2

    @property
    def plane_elems(self) -> int:
        return self.page_size_bytes // self.dtype_bytes // self.num_planes

    @property
    def canonical_shape(self) -> tuple[int, int, int, int]:
        """``[num_tensors, num_planes, num_blocks, plane_elems]``."""
        return (self.num_tensors, self.num_planes, self.num_blocks, self.plane_elems)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every physical tensor (one host block-major row)."""
        return self.num_tensors * self.page_size_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Group 0's per-layer tensor shape (``[num_blocks, *block]``; K/V split:
        ``[2, num_blocks, *block[1:]]``)."""
        block = self.spec.block_shape
        if self.cache_layout is CacheLayout.KV_SPLIT:
            return (2, self.num_blocks, *block[1:])
        return (self.num_blocks, *block)

    def layer_to_tensor(self) -> dict[str, tuple[int, int]]:
        """layer name -> (physical tensor id, group id)."""
        return {
            name: (t.tensor_id, gid)
            for t in self.tensors
            for name, gid in zip(t.layer_names, t.group_ids, strict=True)
        }

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ValueError naming the first field where ``other`` differs from ``self``."""
        if not isinstance(other, KVLayout):
            raise TypeError(f"expected a KVLayout, got {type(other).__name__}")
        for f in fields(self):
            if not f.compare or f.name == "name":
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "groups" and mine != theirs:
                _check_groups(mine, theirs)
            if mine != theirs:
                raise ValueError(
                    f"incompatible KV layout: {f.name} is {mine!r} here, {theirs!r} remote"
                )


def _check_groups(mine: tuple[KVGroup, ...], theirs: tuple[KVGroup, ...]) -> None:
    if len(mine) != len(theirs):
        raise ValueError(
            f"incompatible KV layout: num_groups is {len(mine)} here, {len(theirs)} remote"
        )
    for a, b in zip(mine, theirs, strict=True):
        if len(a.layer_names) != len(b.layer_names):
            raise ValueError(
                f"incompatible KV layout: group {a.group_id} has {len(a.layer_names)} layers "
                f"here, {len(b.layer_names)} remote"
            )
        if a.layer_names != b.layer_names:
            raise ValueError(
                f"incompatible KV layout: group {a.group_id} layer_names differ "
                f"({a.layer_names[:3]}... vs {b.layer_names[:3]}...)"
            )
        if type(a.spec) is not type(b.spec):
            raise ValueError(
                f"incompatible KV layout: group {a.group_id} spec is {type(a.spec).__name__} "
                f"here, {type(b.spec).__name__} remote"
            )
        for f in fields(a.spec):
            x, y = getattr(a.spec, f.name), getattr(b.spec, f.name)
            if x != y:
                raise ValueError(
                    f"incompatible KV layout: group {a.group_id} {f.name} is {x!r} here, "
                    f"{y!r} remote"
                )


def storage_dtype(specs: Iterable[KVSpec]) -> str:
    """The dtype every spec shares, else "uint8": a pool of groups with other dtypes (bf16
    attention pages beside fp32 SSM state) is moved as bytes."""
    names = {spec.dtype for spec in specs}
    return names.pop() if len(names) == 1 else "uint8"


def group_layers(layers: Sequence[tuple[str, KVSpec]]) -> tuple[KVGroup, ...]:
    """vLLM's grouping rule for hybrid models (uniform page size).

    Layers are bucketed by identical spec, in order of first appearance. group_size is
    the smallest bucket, or the largest when max < 1.5 x min. Each bucket of n layers is
    cut into cdiv(n, group_size) groups by striding (layer j -> group j mod num_groups).
    Gemma-3-1b: 22 SW + 4 FA -> group_size 4 -> 6 SW groups (4,4,4,4,3,3) + 1 FA = 7.
    """
    if not layers:
        raise ValueError("group_layers needs at least one (name, spec) pair")
    buckets: dict[KVSpec, list[str]] = {}
    for name, spec in layers:
        buckets.setdefault(spec, []).append(name)
    sizes = [len(v) for v in buckets.values()]
    lo, hi = min(sizes), max(sizes)
    group_size = hi if hi < 1.5 * lo else lo
    groups: list[KVGroup] = []
    for spec, names in buckets.items():
        num = cdiv(len(names), group_size)
        for k in range(num):
            groups.append(
                KVGroup(group_id=len(groups), layer_names=tuple(names[k::num]), spec=spec)
            )
    return tuple(groups)
