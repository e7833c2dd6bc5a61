"""KVLayout: vLLM's grouping rule, presets, page sizes, equality/hash, compatibility
checks naming the first differing field, and every construction error."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import kvstage as ks
from kvstage import (
    PRESETS,
    CacheLayout,
    FullAttentionSpec,
    KVGroup,
    KVLayout,
    MLASpec,
    SlidingWindowSpec,
    group_layers,
    preset,
    synthetic_layout,
)

KIB = 1024


# -- grouping rule and presets ---------------------------------------------------------


def test_gemma_3_1b_has_7_groups_over_4_tensors() -> None:
    lay = preset("gemma-3-1b")
    sizes = [len(g.layer_names) for g in lay.groups]
    kinds = [type(g.spec) for g in lay.groups]
    # 22 SW layers -> group_size 4 -> 6 SW groups (4,4,4,4,3,3); 4 FA layers -> 1 group
    assert sizes == [4, 4, 4, 4, 3, 3, 4]
    assert kinds == [SlidingWindowSpec] * 6 + [FullAttentionSpec]
    assert lay.num_groups == 7 and lay.num_tensors == 4 and lay.num_layers == 26
    # the FA group holds every 6th layer
    assert lay.groups[6].layer_names == ("layers.5", "layers.11", "layers.17", "layers.23")
    # striding inside the SW bucket: SW layer j -> group j mod 6
    sw = [f"layers.{i}" for i in range(26) if i % 6 != 5]
    assert lay.groups[0].layer_names == tuple(sw[0::6])
    assert lay.groups[5].layer_names == tuple(sw[5::6])
    # short groups 4 and 5 have no layer in tensor 3
    assert lay.tensors[3].group_ids == (0, 1, 2, 3, 6)
    assert lay.tensors[0].group_ids == tuple(range(7))


@pytest.mark.parametrize(
    ("name", "groups", "sizes", "tensors"),
    [
        ("gpt-oss-20b", 2, [12, 12], 12),
        ("llama-3.1-8b", 1, [32], 32),
        ("deepseek-v2-lite", 1, [27], 27),
    ],
)
def test_preset_groups(name: str, groups: int, sizes: list[int], tensors: int) -> None:
    lay = preset(name)
    assert lay.num_groups == groups
    assert [len(g.layer_names) for g in lay.groups] == sizes
    assert lay.num_tensors == tensors
    assert lay.name == name


def test_mla_preset_is_one_plane() -> None:
    lay = preset("deepseek-v2-lite")
    assert isinstance(lay.spec, MLASpec) and lay.spec.num_kv_planes == 1
    assert lay.layer_shape == (1024, 16, 576)


def test_group_size_1p5_rule() -> None:
    a = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)
    b = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=64)
    # buckets of 10 and 14: 14 < 1.5 * 10 -> group_size is the LARGEST (14): 1 group each
    groups = group_layers([(f"a{i}", a) for i in range(10)] + [(f"b{i}", b) for i in range(14)])
    assert [len(g.layer_names) for g in groups] == [10, 14]
    # buckets of 10 and 15: 15 >= 1.5 * 10 -> group_size 10: 1 + cdiv(15, 10) = 3 groups
    groups = group_layers([(f"a{i}", a) for i in range(10)] + [(f"b{i}", b) for i in range(15)])
    assert [len(g.layer_names) for g in groups] == [10, 8, 7]
    assert groups[1].layer_names == tuple(f"b{i}" for i in range(0, 15, 2))
    assert [g.group_id for g in groups] == [0, 1, 2]


def test_group_layers_needs_layers() -> None:
    with pytest.raises(ValueError, match="at least one"):
        group_layers([])


@pytest.mark.parametrize(
    ("name", "page"),
    [
        ("gemma-3-1b", 16 * KIB),  # 2 * 16 * 1 * 256 * 2
        ("llama-3.1-8b", 64 * KIB),  # 2 * 16 * 8 * 128 * 2
        ("gpt-oss-20b", 32 * KIB),  # 2 * 16 * 8 * 64 * 2
        ("deepseek-v2-lite", 18 * KIB),  # 16 * 576 * 2
    ],
)
def test_page_size_bytes(name: str, page: int) -> None:
    lay = preset(name, num_blocks=64)
    assert lay.page_size_bytes == page
    assert lay.block_bytes == page * lay.num_tensors
    assert lay.pool_bytes == 64 * page * lay.num_tensors


def test_canonical_and_layer_shapes() -> None:
    lay = preset("llama-3.1-8b", num_blocks=10)
    assert lay.canonical_shape == (32, 1, 10, 2 * 16 * 8 * 128)
    assert lay.layer_shape == (10, 2, 16, 8, 128)
    split = preset("llama-3.1-8b", num_blocks=10, cache_layout=CacheLayout.KV_SPLIT)
    assert split.canonical_shape == (32, 2, 10, 16 * 8 * 128)
    assert split.layer_shape == (2, 10, 16, 8, 128)
    assert CacheLayout.PACKED.block_dim == 0 and CacheLayout.KV_SPLIT.block_dim == 1


def test_layer_to_tensor() -> None:
    m = preset("gemma-3-1b").layer_to_tensor()
    assert len(m) == 26
    assert m["layers.5"] == (0, 6)  # first FA layer: tensor 0 of group 6
    assert m["layers.23"] == (3, 6)
    assert m["layers.0"] == (0, 0)
    sw = [f"layers.{i}" for i in range(26) if i % 6 != 5]
    assert m[sw[6]] == (1, 0)  # SW layer 6 is the second layer of group 0
    tensors = {t for t, _ in m.values()}
    assert tensors == {0, 1, 2, 3}


def test_synthetic_layout_stripes_layers() -> None:
    lay = synthetic_layout(num_layers=16, num_groups=3, num_blocks=8)
    assert [len(g.layer_names) for g in lay.groups] == [6, 5, 5]
    assert lay.num_tensors == 6
    assert lay.groups[1].layer_names[0] == "layers.1"
    assert lay.page_size_bytes == 2 * 16 * 4 * 128 * 2  # 32 KiB, the seed benchmark's


def test_sliding_window_blocks() -> None:
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=512)
    assert sw.blocks_per_window == 33
    assert sw.max_blocks_per_request(10_000) == 33
    assert sw.max_blocks_per_request(17) == 2
    fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)
    assert fa.max_blocks_per_request(10_000) == 625


# -- equality, hash, compatibility --------------------------------------------------------


def test_equal_layouts_hash_equal() -> None:
    a, b = preset("gemma-3-1b", num_blocks=64), preset("gemma-3-1b", num_blocks=64)
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != preset("gemma-3-1b", num_blocks=65)
    assert a != preset("gemma-3-1b", num_blocks=64, cache_layout=CacheLayout.KV_SPLIT)
    a.check_compatible(b)  # no error


def _with_spec(lay: KVLayout, **changes: object) -> KVLayout:
    groups = tuple(
        dataclasses.replace(g, spec=dataclasses.replace(g.spec, **changes)) for g in lay.groups
    )
    return dataclasses.replace(lay, groups=groups)


@pytest.mark.parametrize(
    ("other", "field", "expected"),
    [
        (lambda: synthetic_layout(num_layers=4, num_groups=2, num_blocks=9), "num_blocks", "8"),
        (
            lambda: synthetic_layout(num_layers=4, num_groups=2, num_blocks=8, dtype="bfloat16"),
            "dtype",
            "float16",
        ),
        (
            lambda: synthetic_layout(num_layers=4, num_groups=2, num_blocks=8, block_size=32,
                                     head_size=64),
            "block_size",
            "16",
        ),
        (
            lambda: synthetic_layout(num_layers=4, num_groups=2, num_blocks=8, num_kv_heads=8,
                                     head_size=64),
            "num_kv_heads",
            "4",
        ),
        (
            lambda: synthetic_layout(num_layers=4, num_groups=2, num_blocks=8, head_size=256,
                                     num_kv_heads=2),
            "num_kv_heads",
            "4",
        ),
        (
            lambda: _with_spec(synthetic_layout(num_layers=4, num_groups=2, num_blocks=8),
                               head_size=64),
            "head_size",
            "128",
        ),
        (lambda: synthetic_layout(num_layers=4, num_groups=1, num_blocks=8), "num_groups", "2"),
        (
            lambda: synthetic_layout(num_layers=6, num_groups=2, num_blocks=8),
            "layers",
            "2 layers here, 3 remote",
        ),
        (
            lambda: synthetic_layout(num_layers=4, num_groups=2, num_blocks=8,
                                     cache_layout=CacheLayout.KV_SPLIT),
            "cache_layout",
            "PACKED",
        ),
    ],
)
def test_check_compatible_names_first_difference(other, field: str, expected: str) -> None:  # type: ignore[no-untyped-def]
    base = synthetic_layout(num_layers=4, num_groups=2, num_blocks=8)
    with pytest.raises(ValueError, match="incompatible KV layout") as err:
        base.check_compatible(other())
    msg = str(err.value)
    assert field in msg and expected in msg, msg


def test_check_compatible_layer_names_and_spec_kind() -> None:
    base = synthetic_layout(num_layers=2, num_groups=1, num_blocks=8)
    renamed = dataclasses.replace(
        base,
        groups=(dataclasses.replace(base.groups[0], layer_names=("a", "b")),),
    )
    with pytest.raises(ValueError, match="layer_names differ"):
        base.check_compatible(renamed)
    spec = base.spec
    sw = SlidingWindowSpec(
        block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
        dtype=spec.dtype, sliding_window=64,
    )
    other = dataclasses.replace(base, groups=(dataclasses.replace(base.groups[0], spec=sw),))
    with pytest.raises(ValueError, match="SlidingWindowSpec"):
        base.check_compatible(other)
    with pytest.raises(TypeError, match="expected a KVLayout"):
        base.check_compatible("gemma")  # type: ignore[arg-type]


def test_check_compatible_ignores_name() -> None:
    base = synthetic_layout(num_layers=2, num_groups=1, num_blocks=8)
    dataclasses.replace(base, name="other").check_compatible(base)


# -- construction errors ---------------------------------------------------------------------


def _spec(**kw: object) -> FullAttentionSpec:
    return FullAttentionSpec(**{"block_size": 16, "num_kv_heads": 1, "head_size": 8, **kw})  # type: ignore[arg-type]


def test_zero_blocks() -> None:
    with pytest.raises(ValueError, match=r"num_blocks must be a positive int, got 0"):
        synthetic_layout(num_layers=2, num_groups=1, num_blocks=0)


def test_one_block_is_not_enough() -> None:
    with pytest.raises(ValueError, match=r"num_blocks must be >= 2 \(block 0 is the null block\)"):
        synthetic_layout(num_layers=2, num_groups=1, num_blocks=1)


def test_zero_layers() -> None:
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        synthetic_layout(num_layers=0, num_groups=1, num_blocks=8)
    with pytest.raises(ValueError, match="has no layers"):
        KVGroup(group_id=0, layer_names=(), spec=_spec())
    with pytest.raises(ValueError, match="at least one KVGroup"):
        KVLayout(num_blocks=8, groups=())


def test_more_groups_than_layers() -> None:
    with pytest.raises(ValueError, match=r"num_groups \(3\) cannot exceed num_layers \(2\)"):
        synthetic_layout(num_layers=2, num_groups=3, num_blocks=8)


def test_mismatched_page_sizes() -> None:
    groups = (
        KVGroup(group_id=0, layer_names=("a",), spec=_spec()),
        KVGroup(group_id=1, layer_names=("b",), spec=_spec(head_size=16)),
    )
    with pytest.raises(ValueError, match="group 1 has page 1024 B, group 0 has 512 B"):
        KVLayout(num_blocks=8, groups=groups)


def test_mixed_dtypes_same_page_are_moved_as_bytes() -> None:
    """Groups of one page size but other dtypes (bf16 attention beside fp32 SSM state in
    vLLM's hybrid pools) share tensors: the pool is addressed as uint8, never converted."""
    groups = (
        KVGroup(group_id=0, layer_names=("a",), spec=_spec(dtype="float16")),
        KVGroup(group_id=1, layer_names=("b",), spec=_spec(dtype="bfloat16")),
    )
    lay = KVLayout(num_blocks=8, groups=groups)
    assert lay.storage_dtype == "uint8"
    assert lay.plane_elems == lay.page_size_bytes
    same = KVLayout(num_blocks=8, groups=(groups[0],))
    assert same.storage_dtype == "float16"
    assert same.plane_elems == same.page_size_bytes // 2


def test_duplicate_layer_names() -> None:
    groups = (
        KVGroup(group_id=0, layer_names=("a", "b"), spec=_spec()),
        KVGroup(group_id=1, layer_names=("b",), spec=_spec()),
    )
    with pytest.raises(ValueError, match="layer 'b' appears in more than one group"):
        KVLayout(num_blocks=8, groups=groups)


def test_groups_numbered_in_order() -> None:
    groups = (KVGroup(group_id=1, layer_names=("a",), spec=_spec()),)
    with pytest.raises(ValueError, match=r"must be numbered 0\.\.0"):
        KVLayout(num_blocks=8, groups=groups)


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown preset 'gemma-4'; choose one of") as err:
        preset("gemma-4")
    assert all(name in str(err.value) for name in PRESETS)


def test_kv_split_with_mla() -> None:
    with pytest.raises(ValueError, match="use CacheLayout.PACKED"):
        preset("deepseek-v2-lite", num_blocks=8, cache_layout=CacheLayout.KV_SPLIT)


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of \[.*'bfloat16'.*got 'fp7'"):
        _spec(dtype="fp7")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_bad_spec_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        _spec(block_size=bad)


def test_mla_needs_one_head_and_sliding_window_positive() -> None:
    with pytest.raises(ValueError, match="num_kv_heads must be 1"):
        MLASpec(block_size=16, head_size=576, num_kv_heads=2)
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=0)


# -- bad input: layouts ---------------------------------------------------------------

@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: ks.preset("llama-3.1-8b", num_blocks=0), "num_blocks must be a positive int, "
                                                          "got 0"),
        (lambda: ks.synthetic_layout(num_layers=2, num_groups=1, num_blocks=1),
         "num_blocks must be >= 2 (block 0 is the null block), got 1"),
        (lambda: ks.BlockPool(1), "BlockPool needs num_blocks >= 2 (0 is null), got 1"),
        (lambda: ks.preset("gemma-3-1b", block_size=0), "block_size must be a positive int"),
    ],
    ids=["preset-0", "synthetic-1", "pool-1", "block-size-0"],
)
def test_layout_with_zero_blocks(build: Any, expected: str) -> None:
    with pytest.raises(ValueError) as err:
        build()
    assert expected in str(err.value)


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        (lambda: ks.synthetic_layout(num_layers=0, num_groups=1, num_blocks=8),
         "synthetic_layout.num_layers must be a positive int, got 0"),
        (lambda: ks.synthetic_layout(num_layers=2, num_groups=3, num_blocks=8),
         "num_groups (3) cannot exceed num_layers (2)"),
        (lambda: ks.KVGroup(group_id=0, layer_names=(), spec=ks.FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=64)), "KVGroup 0 has no layers"),
        (lambda: ks.KVLayout(num_blocks=8, groups=()), "KVLayout needs at least one KVGroup"),
        (lambda: ks.group_layers([]), "group_layers needs at least one (name, spec) pair"),
    ],
    ids=["synthetic-0", "more-groups", "empty-group", "no-groups", "no-layers"],
)
def test_layout_with_zero_layers(build: Any, expected: str) -> None:
    with pytest.raises(ValueError) as err:
        build()
    assert expected in str(err.value)


