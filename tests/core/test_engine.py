"""CopyEngine: byte-exact equality of every strategy with a naive per-block reference,
for every preset, both directions, both cache layouts and both host layouts; a
property-based sweep over random layouts and id sets; every bad input raises and moves
no byte; host memory equals the device pool."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvstage as ks
from kvstage import (
    PRESETS,
    BlockPool,
    CacheLayout,
    CopyEngine,
    Direction,
    GroupedBlockIds,
    HostBuffer,
    HostLayout,
    KVCache,
    KVLayout,
    memory_report,
    preset,
    synthetic_layout,
)
from kvstage.layout import DTYPES
from kvstage.plan import INDEX_BYTES
from kvstage.presets import STATE_PRESETS, cache_layouts_for, synthetic_hybrid_layout
from kvstage.testing.baselines import Strategy, make_engine
from tests.helpers import (
    as_bytes,
    assert_unchanged,
    check_invariants,
    fill_host_random,
    make_pair,
    ok_ids,
    raw_bytes,
    snap,
)

NUM_BLOCKS = 32

# (strategy, mode) variants: the two vLLM-faithful baselines and fused in both modes
VARIANTS = [("per_group", "direct"), ("coalesced", "direct"), ("fused", "direct"),
            ("fused", "staged")]

# the state-group presets' pages are MiBs: tests/core/test_state_groups.py copies them at a
# few blocks, and a small synthetic state hybrid runs in the property sweep below
ATTENTION_PRESETS = [name for name in PRESETS if name not in STATE_PRESETS]
CONFIGS = [
    (name, cl, hl)
    for name in ATTENTION_PRESETS
    for cl in cache_layouts_for(name)  # MLA: packed only
    for hl in HostLayout
]


def request_ids(layout: KVLayout) -> list[list[int]]:
    """A realistic request: scattered ids (a pool after some churn), null padding at the
    start of sliding-window groups, an empty group when there are several groups."""
    pool = BlockPool(layout.num_blocks)
    first = pool.allocate(12)
    pool.free(first[::3])  # ids 1, 4, 7, 10 go back to the tail: later ids scatter
    sizes = {1: [20], 2: [4, 12], 7: [3, 3, 3, 0, 2, 2, 6]}[layout.num_groups]
    groups = []
    for g, n in enumerate(sizes):
        ids = pool.allocate(n)
        if n and g < len(sizes) - 1:
            ids = [0, 0, *ids]  # null padding (sliding-window groups)
        groups.append(ids)
    return groups


def _restore(canonical: torch.Tensor, image: torch.Tensor) -> None:
    canonical.view(torch.uint8).copy_(image)


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: f"{c[0]}-{c[1].value}-{c[2].value}")
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVCache, HostBuffer]]:
    name, cl, hl = request.param
    lay = preset(name, num_blocks=NUM_BLOCKS, cache_layout=cl)
    yield make_pair(KVCache(lay), HostBuffer(lay, hl), seed=hash(request.param) % 1000)


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D], ids=lambda d: d.value)
@pytest.mark.parametrize(("strategy", "mode"), VARIANTS, ids=[f"{s}-{m}" for s, m in VARIANTS])
def test_strategies_byte_exact_vs_naive(
    pair: tuple[KVCache, HostBuffer], direction: Direction, strategy: str, mode: str
) -> None:
    cache, host = pair
    lay = cache.layout
    groups = request_ids(lay)
    flat = [b for g in groups for b in g]
    src, dst = (cache, host) if direction is Direction.D2H else (host, cache)
    src_before, dst_before = as_bytes(src.canonical), as_bytes(dst.canonical)
    mapped = sorted(set(flat) - {0})
    # precondition: both sides hold different random bytes at every mapped block, so a
    # skipped or misplaced copy cannot pass
    for b in mapped:
        assert not torch.equal(src_before[:, :, b], dst_before[:, :, b])
    # a budget of 3 blocks: the staged copy goes through several chunks
    engine = make_engine(cache, host, strategy, mode=mode,  # type: ignore[arg-type]
                        max_temp_bytes=3 * (lay.block_bytes + INDEX_BYTES))
    try:
        stats = engine.copy(groups, direction)
        check_invariants(
            src_before=src_before, src_after=as_bytes(src.canonical),
            dst_before=dst_before, dst_after=as_bytes(dst.canonical),
            ids=flat, null_may_change=strategy != "fused",
        )
        if strategy == "fused":
            # fused never touches the null block, even though 0 is in the ids
            assert torch.equal(as_bytes(dst.canonical)[:, :, 0], dst_before[:, :, 0])
            assert stats.blocks == len(mapped)
            assert stats.nbytes == len(mapped) * lay.block_bytes
            if mode == "staged":
                assert stats.chunks == -(-len(mapped) // 3) and stats.chunks > 1
    finally:
        _restore(dst.canonical, dst_before)  # the next test starts from the same bytes


def test_baselines_do_copy_null_block() -> None:
    """vLLM's per-layer copy writes block 0 when it is in the ids; fused skips it."""
    lay = preset("gemma-3-1b", num_blocks=8)
    for strategy, touched in (("per_group", True), ("coalesced", True), ("fused", False)):
        cache, host = make_pair(KVCache(lay), HostBuffer(lay), seed=3)
        before = as_bytes(host.canonical)
        make_engine(cache, host, strategy).save_to_host([[0, 1]] + [[]] * 6)
        after = as_bytes(host.canonical)
        assert torch.equal(after[:, :, 0], as_bytes(cache.canonical)[:, :, 0]) is touched
        assert torch.equal(after[:, :, 0], before[:, :, 0]) is not touched


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D], ids=lambda d: d.value)
def test_trusted_copy_equals_checked_copy(
    pair: tuple[KVCache, HostBuffer], direction: Direction
) -> None:
    cache, host = pair
    groups = request_ids(cache.layout)
    src, dst = (cache, host) if direction is Direction.D2H else (host, cache)
    src_before, dst_before = as_bytes(src.canonical), as_bytes(dst.canonical)
    engine = CopyEngine(cache, host)
    try:
        stats = engine.copy(groups, direction, trusted=True)
        check_invariants(
            src_before=src_before, src_after=as_bytes(src.canonical),
            dst_before=dst_before, dst_after=as_bytes(dst.canonical),
            ids=[b for g in groups for b in g], null_may_change=False,
        )
        assert stats == engine.copy(groups, direction)  # same work, same stats
    finally:
        _restore(dst.canonical, dst_before)


def test_trusted_still_checks_the_shape() -> None:
    cache, host = make_pair(KVCache(ERR_LAYOUT), HostBuffer(ERR_LAYOUT), seed=14)
    dev, hst = as_bytes(cache.canonical), as_bytes(host.canonical)
    engine = CopyEngine(cache, host)
    with pytest.raises(ValueError, match="expected 7 block-id lists"):
        engine.load_to_device([[1, 2]], trusted=True)
    with pytest.raises(TypeError, match="got a flat list of ids"):
        engine.save_to_host([1, 2, 3, 4, 5, 6, 7], trusted=True)
    assert torch.equal(as_bytes(cache.canonical), dev)
    assert torch.equal(as_bytes(host.canonical), hst)


def test_engine_default_mode_on_cpu_is_direct() -> None:
    lay = synthetic_layout(num_layers=2, num_groups=1, num_blocks=4, head_size=8)
    engine = CopyEngine(KVCache(lay), HostBuffer(lay))
    assert isinstance(engine, CopyEngine) and engine.mode == "direct"
    stats = engine.save_to_host([[1, 2]])
    assert (stats.blocks, stats.runs, stats.chunks) == (2, 1, 0)


# -- property-based: random layouts, ids, strategies, modes ------------------------------------


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    if draw(st.booleans()):
        name = draw(st.sampled_from(ATTENTION_PRESETS))
        lay = preset(name, num_blocks=draw(st.integers(4, 12)), block_size=1,
                     cache_layout=draw(st.sampled_from(cache_layouts_for(name))))
    elif draw(st.booleans()):
        lay = synthetic_hybrid_layout(
            num_attention=draw(st.integers(1, 3)), num_state=draw(st.integers(1, 9)),
            num_blocks=draw(st.integers(4, 64)),
        )
    else:
        layers = draw(st.integers(1, 12))
        lay = synthetic_layout(
            num_layers=layers,
            num_groups=draw(st.integers(1, layers)),
            num_blocks=draw(st.integers(4, 64)),
            block_size=draw(st.integers(1, 4)),
            num_kv_heads=draw(st.integers(1, 2)),
            head_size=draw(st.integers(1, 8)),
            dtype=draw(st.sampled_from(sorted(DTYPES))),
            cache_layout=draw(st.sampled_from(list(CacheLayout))),
        )
    perm = draw(st.permutations(range(1, lay.num_blocks)))
    used = perm[: draw(st.integers(0, len(perm)))]
    g = lay.num_groups
    cuts = sorted(draw(st.lists(st.integers(0, len(used)), min_size=g - 1, max_size=g - 1)))
    bounds = [0, *cuts, len(used)]
    groups = [
        [0] * draw(st.integers(0, 3)) + list(used[bounds[i] : bounds[i + 1]]) for i in range(g)
    ]
    strategy, mode = draw(st.sampled_from(VARIANTS))
    return {
        "layout": lay,
        "groups": groups,
        "strategy": strategy,
        "mode": mode,
        "host_layout": draw(st.sampled_from(list(HostLayout))),
        "direction": draw(st.sampled_from(list(Direction))),
        "budget_blocks": draw(st.integers(1, 8)),
        "seed": draw(st.integers(0, 2**16)),
    }


@given(cases())
def test_property_byte_exact_vs_naive(case: dict[str, Any]) -> None:
    lay: KVLayout = case["layout"]
    cache, host = make_pair(KVCache(lay), HostBuffer(lay, case["host_layout"]), case["seed"])
    engine = make_engine(cache, host, case["strategy"], mode=case["mode"],
                        max_temp_bytes=case["budget_blocks"] * (lay.block_bytes + INDEX_BYTES))
    direction: Direction = case["direction"]
    src, dst = (cache, host) if direction is Direction.D2H else (host, cache)
    src_before, dst_before = as_bytes(src.canonical), as_bytes(dst.canonical)
    engine.copy(case["groups"], direction)
    check_invariants(
        src_before=src_before, src_after=as_bytes(src.canonical),
        dst_before=dst_before, dst_after=as_bytes(dst.canonical),
        ids=[b for g in case["groups"] for b in g],
        null_may_change=case["strategy"] != "fused",
    )


# -- bad inputs: a clear error, and no byte moved ------------------------------------------------

ERR_LAYOUT = preset("gemma-3-1b", num_blocks=16)
OK = [[1, 2], [3], [], [], [], [], [4]]


def _with(g: int, ids: list[Any]) -> list[list[Any]]:
    groups: list[list[Any]] = [list(x) for x in OK]
    groups[g] = ids
    return groups


BAD_IDS = [
    ("one group", [[1, 2]], ValueError, r"expected 7 block-id lists .*got 1"),
    ("eight groups", OK + [[]], ValueError, r"expected 7 block-id lists .*got 8"),
    ("out of range", _with(2, [16]), ValueError, r"block id 16 is out of range.*\[0, 16\)"),
    ("negative", _with(2, [-2]), ValueError, r"block id -2 is negative.*\[0, 16\)"),
    ("repeat in group", _with(0, [5, 6, 5]), ValueError, "block id 5 appears twice in group 0"),
    ("repeat across", _with(6, [1]), ValueError, r"block id 1 appears in groups \[0, 6\]"),
    ("float id", _with(1, [3.0]), TypeError, "group 1 block ids must be ints"),
    ("str id", _with(1, ["3"]), TypeError, "group 1 block ids must be ints"),
    ("none id", _with(1, [None]), TypeError, "group 1 block ids must be ints"),
    ("flat list", [1, 2, 3, 4, 5, 6, 7], TypeError, "got a flat list of ids"),
    ("nested list", _with(0, [1, [2]]), TypeError, "group 0 holds a nested list"),
    ("bool id", _with(6, [4, True]), TypeError, "group 6 block ids must be ints, got a bool"),
    ("other layout", GroupedBlockIds([[1]], preset("llama-3.1-8b", num_blocks=16)), ValueError,
     r"ids validated for 1 groups x 16 blocks; this engine's layout has 7 x 16"),
    ("other num_blocks", GroupedBlockIds(OK, preset("gemma-3-1b", num_blocks=32)), ValueError,
     r"7 groups x 32 blocks; this engine's layout has 7 x 16"),
]


@pytest.mark.parametrize("strategy", [s.value for s in Strategy])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize(("what", "ids", "exc", "match"), BAD_IDS, ids=[b[0] for b in BAD_IDS])
def test_bad_ids_raise_and_move_nothing(
    what: str, ids: Any, exc: type[Exception], match: str, direction: Direction, strategy: str
) -> None:
    cache, host = make_pair(KVCache(ERR_LAYOUT), HostBuffer(ERR_LAYOUT), seed=11)
    dev, hst = as_bytes(cache.canonical), as_bytes(host.canonical)
    engine = make_engine(cache, host, strategy)
    with pytest.raises(exc, match=match):
        engine.copy(ids, direction)
    assert torch.equal(as_bytes(cache.canonical), dev), what
    assert torch.equal(as_bytes(host.canonical), hst), what


def test_bad_ids_for_plan_too() -> None:
    engine = CopyEngine(KVCache(ERR_LAYOUT), HostBuffer(ERR_LAYOUT))
    with pytest.raises(ValueError, match="expected 7 block-id lists"):
        engine.plan([[1]])


def test_unknown_direction_moves_nothing() -> None:
    cache, host = make_pair(KVCache(ERR_LAYOUT), HostBuffer(ERR_LAYOUT), seed=12)
    dev, hst = as_bytes(cache.canonical), as_bytes(host.canonical)
    with pytest.raises(ValueError, match="'sideways' is not a valid Direction"):
        CopyEngine(cache, host).copy(OK, "sideways")  # type: ignore[arg-type]
    assert torch.equal(as_bytes(cache.canonical), dev)
    assert torch.equal(as_bytes(host.canonical), hst)


def test_unknown_baseline_strategy_is_refused() -> None:
    cache, host = make_pair(KVCache(ERR_LAYOUT), HostBuffer(ERR_LAYOUT), seed=13)
    with pytest.raises(ValueError, match=r"unknown strategy .per_layer.; choose one"):
        make_engine(cache, host, "per_layer")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "fast"}, "mode must be 'auto', 'direct' or 'staged', got 'fast'"),
        ({"max_temp_bytes": 0}, "max_temp_bytes must be a positive int, got 0"),
        ({"max_temp_bytes": -8}, "max_temp_bytes must be a positive int, got -8"),
        ({"max_temp_bytes": 1.5e6}, "max_temp_bytes must be a positive int, got 1500000.0"),
        ({"max_temp_bytes": "8M"}, "max_temp_bytes must be a positive int, got '8M'"),
        ({"max_temp_bytes": True}, "max_temp_bytes must be a positive int, got True"),
    ],
)
def test_bad_engine_arguments(kwargs: dict[str, Any], match: str) -> None:
    cache, host = make_pair(KVCache(ERR_LAYOUT), HostBuffer(ERR_LAYOUT), seed=13)
    dev, hst = as_bytes(cache.canonical), as_bytes(host.canonical)
    with pytest.raises(ValueError, match=match):
        CopyEngine(cache, host, **kwargs)
    assert torch.equal(as_bytes(cache.canonical), dev)
    assert torch.equal(as_bytes(host.canonical), hst)


def test_engine_from_different_layouts() -> None:
    cache = KVCache(ERR_LAYOUT)
    host = HostBuffer(preset("gemma-3-1b", num_blocks=17))
    with pytest.raises(ValueError, match="built for different layouts: gemma-3-1b vs gemma-3-1b"):
        CopyEngine(cache, host)
    with pytest.raises(ValueError, match="different layouts"):
        CopyEngine(cache, HostBuffer(preset("gemma-3-1b", num_blocks=16,
                                            cache_layout=CacheLayout.KV_SPLIT)))


def test_bad_host_layout_and_pinning() -> None:
    with pytest.raises(TypeError, match="host_layout must be a HostLayout, got 'mirror'"):
        HostBuffer(ERR_LAYOUT, "mirror")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            HostBuffer(ERR_LAYOUT, pin_memory=True)
        with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
            KVCache(ERR_LAYOUT, device="cuda")


# -- memory ------------------------------------------------------------------------------------


def test_host_buffer_equals_device_pool_for_gemma() -> None:
    lay = preset("gemma-3-1b", num_blocks=64)
    cache = KVCache(lay)
    for hl in HostLayout:
        host = HostBuffer(lay, hl)
        # measured from the allocated tensors: one slab each, 4 tensors x 64 blocks x 16 KiB
        assert host.nbytes == cache.nbytes == 4 * 64 * 16 * 1024 == lay.pool_bytes
        assert host.storage.untyped_storage().nbytes() == cache.slab.untyped_storage().nbytes()
    report = memory_report(lay)
    assert report["device_bytes"] == report["host_bytes"] == cache.nbytes
    # vLLM allocates one host buffer per layer name: 26 layers over 4 physical tensors
    assert report["vllm_host_bytes"] == 26 * 64 * 16 * 1024
    assert report["vllm_host_bytes"] / report["host_bytes"] == 6.5


def test_layer_views_alias_one_slab() -> None:
    lay = preset("gemma-3-1b", num_blocks=8)
    cache, host = KVCache(lay), HostBuffer(lay, HostLayout.MIRROR)
    views = cache.layer_caches()
    assert len(views) == 26 and all(v.shape == (8, 2, 16, 1, 256) for v in views.values())
    m = lay.layer_to_tensor()
    ptrs = {name: v.data_ptr() for name, v in views.items()}
    for a, (ta, _) in m.items():
        for b, (tb, _) in m.items():
            assert (ptrs[a] == ptrs[b]) == (ta == tb)
    assert {v.data_ptr() for v in host.layer_views().values()} == {
        host.data_ptr + t * 8 * lay.page_size_bytes for t in range(4)
    }
    fill_host_random(host, 1)  # the helper writes every byte of the one allocation
    assert as_bytes(host.canonical).float().mean() > 1


@pytest.mark.gpu
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize(("strategy", "mode"), VARIANTS, ids=[f"{s}-{m}" for s, m in VARIANTS])
@pytest.mark.parametrize("host_layout", list(HostLayout), ids=lambda h: h.value)
def test_cuda_byte_exact_vs_naive(
    host_layout: HostLayout, strategy: str, mode: str, direction: Direction
) -> None:
    lay = preset("gemma-3-1b", num_blocks=NUM_BLOCKS)
    cache = KVCache(lay, "cuda")
    host = HostBuffer.for_device(lay, "cuda", host_layout)
    make_pair(cache, host, seed=21)
    engine = make_engine(cache, host, strategy, mode=mode,  # type: ignore[arg-type]
                        max_temp_bytes=3 * (lay.block_bytes + INDEX_BYTES))
    groups = request_ids(lay)
    src, dst = (cache, host) if direction is Direction.D2H else (host, cache)
    src_before, dst_before = as_bytes(src.canonical), as_bytes(dst.canonical)
    engine.copy(groups, direction)
    check_invariants(
        src_before=src_before, src_after=as_bytes(src.canonical),
        dst_before=dst_before, dst_after=as_bytes(dst.canonical),
        ids=[b for g in groups for b in g], null_may_change=strategy != "fused",
    )


# -- bad input: block ids -------------------------------------------------------------

@pytest.mark.parametrize("direction", list(ks.Direction))
def test_ids_out_of_range(engine: ks.CopyEngine, direction: ks.Direction) -> None:
    before = snap(engine)
    ids = ok_ids()
    ids[6].append(64)  # num_blocks is 64: valid ids are 0..63
    with pytest.raises(ValueError, match=r"block id 64 is out of range: ids must be in \[0, 64\)"):
        engine.copy(ids, direction)
    assert_unchanged(engine, before)


def test_negative_ids(engine: ks.CopyEngine) -> None:
    before = snap(engine)
    ids = ok_ids()
    ids[0][0] = -3
    with pytest.raises(ValueError, match=r"block id -3 is negative: ids must be in \[0, 64\)"):
        engine.save_to_host(ids)
    assert_unchanged(engine, before)


def test_duplicate_id_within_a_group(engine: ks.CopyEngine) -> None:
    before = snap(engine)
    ids = ok_ids()
    ids[6] = [16, 17, 16]
    with pytest.raises(ValueError, match="block id 16 appears twice in group 6: non-null ids "
                       "are unique across all groups"):
        engine.load_to_device(ids)
    assert_unchanged(engine, before)


def test_duplicate_id_across_groups(engine: ks.CopyEngine) -> None:
    before = snap(engine)
    ids = ok_ids()
    ids[3] = [10]  # also in group 0
    with pytest.raises(ValueError, match=r"block id 10 appears in groups \[0, 3\]"):
        engine.save_to_host(ids)
    # the null id may repeat anywhere: that is not a duplicate
    engine.plan([[0, 10], [0], [0], [0], [0], [0], [0, 11]])
    assert_unchanged(engine, before)


@pytest.mark.parametrize("num_lists", [0, 1, 6, 8])
def test_wrong_number_of_groups(engine: ks.CopyEngine, num_lists: int) -> None:
    before = snap(engine)
    ids = [[20 + g] for g in range(num_lists)]
    with pytest.raises(ValueError, match=rf"expected 7 block-id lists \(one per KV cache group "
                       rf"of gemma-3-1b\), got {num_lists}; pass \[\] for a group"):
        engine.save_to_host(ids)
    assert_unchanged(engine, before)


@pytest.mark.parametrize(
    ("ids", "err"),
    [
        ("1,2,3", TypeError),
        ([[1.5], [], [], [], [], [], []], TypeError),
        ([["a"], [], [], [], [], [], []], TypeError),
        ([np.array([1.0]), [], [], [], [], [], []], TypeError),
    ],
    ids=["string", "float", "str-id", "float-array"],
)
def test_non_integer_ids(engine: ks.CopyEngine, ids: Any, err: type[Exception]) -> None:
    before = snap(engine)
    with pytest.raises(err, match="must be (ints|a sequence of per-group id lists)"):
        engine.save_to_host(ids)
    assert_unchanged(engine, before)


def test_ids_validated_for_another_layout(engine: ks.CopyEngine) -> None:
    before = snap(engine)
    other = ks.preset("gemma-3-1b", num_blocks=128, block_size=4)
    ids = ks.GroupedBlockIds([[100], [], [], [], [], [], []], other)
    with pytest.raises(ValueError, match=r"ids validated for 7 groups x 128 blocks; this "
                       r"engine's layout has 7 x 64"):
        engine.save_to_host(ids)
    with pytest.raises(ValueError, match="rebuild them for it"):
        ks.plan_copy(engine.layout, ids)
    assert_unchanged(engine, before)




# -- bad input: engine set-up ---------------------------------------------------------

@pytest.mark.parametrize(
    ("host_kwargs", "expected"),
    [
        ({"dtype": "bfloat16"}, "group 0 dtype is 'float16' (cache), 'bfloat16' (host)"),
        ({"num_blocks": 32}, "num_blocks is 16 (cache), 32 (host)"),
        ({"head_size": 64}, "group 0 head_size is 128 (cache), 64 (host)"),
        ({"cache_layout": ks.CacheLayout.KV_SPLIT}, "cache_layout is <CacheLayout.PACKED"),
    ],
    ids=["dtype", "num_blocks", "shape", "cache-layout"],
)
def test_cache_and_host_of_different_layouts(host_kwargs: dict[str, Any], expected: str) -> None:
    base: dict[str, Any] = {"num_layers": 4, "num_groups": 2, "num_blocks": 16}
    cache = ks.KVCache(ks.synthetic_layout(**base))
    cache.fill_random(3)
    host = ks.HostBuffer(ks.synthetic_layout(**(base | host_kwargs)))
    cache_before, host_before = raw_bytes(cache.slab), raw_bytes(host.storage)
    with pytest.raises(ValueError) as err:
        ks.CopyEngine(cache, host)
    msg = str(err.value)
    assert "device cache and host buffer were built for different layouts" in msg
    assert expected in msg
    assert "build both from one KVLayout" in msg
    assert torch.equal(raw_bytes(cache.slab), cache_before)
    assert torch.equal(raw_bytes(host.storage), host_before)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mode": "turbo"}, "mode must be 'auto', 'direct' or 'staged', got 'turbo'"),
        ({"max_temp_bytes": 0}, "max_temp_bytes must be a positive int, got 0"),
        ({"max_temp_bytes": 1.5}, "max_temp_bytes must be a positive int, got 1.5"),
    ],
    ids=["mode", "budget-zero", "budget-float"],
)
def test_engine_bad_options(engine: ks.CopyEngine, kwargs: dict[str, Any], expected: str) -> None:
    before = snap(engine)
    with pytest.raises(ValueError) as err:
        ks.CopyEngine(engine.cache, engine.host, **kwargs)
    assert expected in str(err.value)
    with pytest.raises(ValueError, match="max_temp_bytes must be a positive int, got -1"):
        ks.plan_copy(engine.layout, ks.GroupedBlockIds(ok_ids(), engine.layout),
                     max_temp_bytes=-1)
    assert_unchanged(engine, before)


def test_wrong_device_and_pinning() -> None:
    layout = ks.synthetic_layout(num_layers=2, num_groups=1, num_blocks=8)
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA refusals; this machine has CUDA")
    with pytest.raises(ValueError, match=r"device='cuda' requested but "
                       r"torch.cuda.is_available\(\) is False"):
        ks.KVCache(layout, device="cuda")
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        ks.HostBuffer(layout, pin_memory=True)
    with pytest.raises(TypeError, match="host_layout must be a HostLayout, got 'mirror'"):
        ks.HostBuffer(layout, "mirror")  # type: ignore[arg-type]


