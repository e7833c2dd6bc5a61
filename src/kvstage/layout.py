"""KV cache layout: attention specs, KV cache groups, physical tensors, model presets.

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
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields

import torch

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{owner}.{name} must be a positive int, got {value!r}; "
                f"pass e.g. {name}=16"
            )


class CacheLayout(enum.Enum):
    """How one physical tensor is shaped on the device."""

    PACKED = "packed"
    KV_SPLIT = "kv_split"

    @property
    def block_dim(self) -> int:
        return 0 if self is CacheLayout.PACKED else 1


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """Base of the attention specs: K and V of ``num_kv_heads`` heads of ``head_size`` per
    token. Use a concrete subclass (`FullAttentionSpec`, `SlidingWindowSpec`, `MLASpec`);
    as in vLLM's ``kv_cache_interface``, groups are bucketed by spec equality, which
    includes the class."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _require_positive(
            type(self).__name__,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
        )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"{type(self).__name__}.dtype must be one of {sorted(DTYPES)}, "
                f"got {self.dtype!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def num_kv_planes(self) -> int:
        """2 (K and V); MLA stores a single latent plane."""
        return 2

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one layer, planes first."""
        return (self.num_kv_planes, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (llama-3.1-8b: 2*16*8*128*2 = 64 KiB)."""
        return math.prod(self.block_shape) * self.dtype_bytes

    def max_blocks_per_request(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention: every token of the request is attended, so every block moves."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: only the last ``sliding_window`` tokens are attended."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("SlidingWindowSpec", sliding_window=self.sliding_window)

    @property
    def blocks_per_window(self) -> int:
        """vLLM's exchange clip: cdiv(window, block_size) + 1 (512 / 16 -> 33)."""
        return cdiv(self.sliding_window, self.block_size) + 1

    def max_blocks_per_request(self, num_tokens: int) -> int:
        return min(super().max_blocks_per_request(num_tokens), self.blocks_per_window)


@dataclass(frozen=True, kw_only=True)
class MLASpec(AttentionSpec):
    """Multi-head latent attention: one plane of ``head_size`` = latent + rope dims."""

    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads != 1:
            raise ValueError(f"MLASpec.num_kv_heads must be 1, got {self.num_kv_heads}")

    @property
    def num_kv_planes(self) -> int:
        return 1

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.head_size)


@dataclass(frozen=True, kw_only=True)
class KVGroup:
    """Layers that share one block table (and one spec)."""

    group_id: int
    layer_names: tuple[str, ...]
    spec: AttentionSpec

    def __post_init__(self) -> None:
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
            if spec.page_size_bytes != first.page_size_bytes or spec.dtype != first.dtype:
                raise ValueError(
                    f"group {group.group_id} has page {spec.page_size_bytes} B {spec.dtype}, "
                    f"group 0 has {first.page_size_bytes} B {first.dtype}: groups sharing "
                    "physical tensors need one page size and dtype (pad or rescale block sizes)"
                )
            if spec.num_kv_planes != first.num_kv_planes:
                raise ValueError("all groups must have the same number of planes (K/V vs MLA)")
        if self.cache_layout is CacheLayout.KV_SPLIT and first.num_kv_planes != 2:
            raise ValueError(
                "CacheLayout.KV_SPLIT needs K and V planes; MLA has one latent plane: "
                "use CacheLayout.PACKED"
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
    def spec(self) -> AttentionSpec:
        return self.groups[0].spec

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.spec.torch_dtype

    @property
    def page_size_bytes(self) -> int:
        return self.spec.page_size_bytes

    @property
    def num_planes(self) -> int:
        """Planes of a tensor's canonical view: 1 (K and V packed per block) or 2 (K/V split)."""
        return 1 if self.cache_layout is CacheLayout.PACKED else 2

    @property
    def plane_elems(self) -> int:
        return self.page_size_bytes // self.spec.dtype_bytes // self.num_planes

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
        """The per-layer tensor shape vLLM hands to the connector."""
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


def group_layers(layers: list[tuple[str, AttentionSpec]]) -> tuple[KVGroup, ...]:
    """vLLM's grouping rule for hybrid models (uniform page size).

    Layers are bucketed by identical spec, in order of first appearance. group_size is
    the smallest bucket, or the largest when max < 1.5 x min. Each bucket of n layers is
    cut into cdiv(n, group_size) groups by striding (layer j -> group j mod num_groups).
    Gemma-3-1b: 22 SW + 4 FA -> group_size 4 -> 6 SW groups (4,4,4,4,3,3) + 1 FA = 7.
    """
    if not layers:
        raise ValueError("group_layers needs at least one (name, spec) pair")
    buckets: dict[AttentionSpec, list[str]] = {}
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
