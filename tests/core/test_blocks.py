"""Block ids: the shared BlockPool (null block 0, free-queue scattering, misuse errors),
GroupedBlockIds validation, and vLLM's sliding-window clip."""

from __future__ import annotations

import numpy as np
import pytest

import kvstage as ks
from kvstage import NULL_BLOCK, BlockPool, GroupedBlockIds, clip_to_window, preset
from kvstage.blocks import request_blocks
from kvstage.presets import synthetic_layout
from tests.helpers import pool_state

LAYOUT = synthetic_layout(num_layers=4, num_groups=2, num_blocks=16, head_size=8)


# -- BlockPool ------------------------------------------------------------------------------


def test_pool_never_hands_out_null_block() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(7)
    assert NULL_BLOCK not in ids and sorted(ids) == list(range(1, 8))
    assert pool.num_free == 0 and pool.num_used == 7
    pool.free([0, *ids])  # the null id in a free list is ignored, like vLLM's
    assert pool.num_free == 7 and pool.num_used == 0


def test_pool_allocates_from_head_and_frees_to_tail() -> None:
    pool = BlockPool(10)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(2) == [4, 5]
    pool.free([2, 1])  # appended in the order given
    pool.free([5, 4])
    assert pool.allocate(4) == [6, 7, 8, 9]
    assert pool.allocate(4) == [2, 1, 5, 4]


def test_free_order_scatters_after_recycling() -> None:
    pool = BlockPool(10)
    first = pool.allocate(6)  # 1..6
    pool.free([first[4], first[1], first[5]])  # 5, 2, 6 back to the tail
    rest = pool.allocate(3)  # 7, 8, 9
    assert rest == [7, 8, 9]
    recycled = pool.allocate(3)
    assert recycled == [5, 2, 6]
    assert np.any(np.diff(recycled) != 1)


def test_pool_double_free_raises() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(3)
    pool.free(ids)
    with pytest.raises(ValueError, match=r"not allocated \(or repeated\): \[1, 2, 3\]"):
        pool.free(ids)
    assert pool.num_free == 7


def test_pool_repeated_id_in_one_free_raises() -> None:
    pool = BlockPool(8)
    pool.allocate(3)
    with pytest.raises(ValueError, match="freed exactly once"):
        pool.free([1, 1])
    assert pool.num_used == 3  # nothing was freed


def test_pool_over_allocation_raises() -> None:
    pool = BlockPool(5)
    pool.allocate(2)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks: only 2 of 4 are free"):
        pool.allocate(3)
    assert pool.num_free == 2


@pytest.mark.parametrize("bad", [1, 0, -3, 2.0])
def test_pool_size_errors(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks >= 2"):
        BlockPool(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_pool_allocate_count_errors(bad: object) -> None:
    with pytest.raises(ValueError, match="int n >= 0"):
        BlockPool(8).allocate(bad)  # type: ignore[arg-type]


# -- GroupedBlockIds ---------------------------------------------------------------------------


def test_grouped_ids_flat_and_groups() -> None:
    ids = GroupedBlockIds([[0, 0, 5, 3], [7]], LAYOUT)
    assert ids.flat.tolist() == [0, 0, 5, 3, 7]
    assert ids.group_sizes.tolist() == [4, 1]
    assert ids.groups == [[0, 0, 5, 3], [7]]
    assert ids.group(1).tolist() == [7]
    assert ids.unique_ids().tolist() == [3, 5, 7]
    assert len(ids) == 5 and ids.num_groups == 2
    with pytest.raises(ValueError):
        ids.flat[0] = 1  # read-only


def test_grouped_ids_empty_groups_and_numpy_input() -> None:
    ids = GroupedBlockIds([[], np.array([4, 2], dtype=np.int32)], LAYOUT)
    assert ids.groups == [[], [4, 2]]
    assert GroupedBlockIds([[], []], LAYOUT).unique_ids().size == 0


def test_null_id_may_repeat_across_groups() -> None:
    ids = GroupedBlockIds([[0, 0, 1], [0, 2]], LAYOUT)
    assert ids.unique_ids().tolist() == [1, 2]


@pytest.mark.parametrize(
    ("groups", "exc", "match"),
    [
        ([[1, 2]], ValueError, r"expected 2 block-id lists .* got 1; pass \[\] for a group"),
        ([[1], [2], [3]], ValueError, "expected 2 block-id lists"),
        ([[1, 16], []], ValueError, r"block id 16 is out of range: ids must be in \[0, 16\)"),
        ([[1], [-1]], ValueError, r"block id -1 is negative"),
        ([[3, 4, 3], []], ValueError, "block id 3 appears twice in group 0"),
        ([[3], [5, 3]], ValueError, r"block id 3 appears in groups \[0, 1\]"),
        ([[1.5], []], TypeError, "group 0 block ids must be ints"),
        ([[1], ["2"]], TypeError, "group 1 block ids must be ints"),
        ([[True], []], TypeError, "must be ints"),
        ([[1, None], []], TypeError, "must be ints"),
        ([np.array([1.0]), []], TypeError, "dtype float64"),
        ("12", TypeError, "sequence of per-group id lists"),
        (7, TypeError, "sequence of per-group id lists"),
        # careless input (issue 13): each of these was accepted before
        ([1, 2], TypeError, r"one list per KV cache group, got a flat list of ids \[1, 2\]"),
        ([[1], 2], TypeError, "got a flat list of ids"),
        ([[[1, 2]], []], TypeError, r"group 0 holds a nested list \[\[1, 2\]\]"),
        ([[1, [2, 3]], []], TypeError, "group 0 holds a nested list"),
        ([[1, True], []], TypeError, "group 0 block ids must be ints, got a bool in"),
        ([[], [False]], TypeError, "group 1 block ids must be ints, got a bool"),
        ([np.array([[1, 2]]), []], TypeError, r"flat 1-D list of ints, got an array of shape"),
        ([np.int64(3), []], TypeError, "got a flat list of ids"),
        ([{1, 2}, []], TypeError, "group 0 block ids must be ints in a list, got set"),
    ],
)
def test_grouped_ids_errors(groups: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        GroupedBlockIds(groups, LAYOUT)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [5, 300])  # below and above SMALL_IDS: both checks
def test_grouped_ids_errors_large_and_small(n: int) -> None:
    lay = synthetic_layout(num_layers=4, num_groups=2, num_blocks=1024, head_size=8)
    ids = list(range(1, n + 1))
    cases = [
        ([ids + [True], []], TypeError, "got a bool"),
        ([ids + [1.0], []], TypeError, "must be ints"),
        ([ids, [n]], ValueError, rf"block id {n} appears in groups \[0, 1\]"),
        ([ids + [1024], []], ValueError, "block id 1024 is out of range"),
        ([[-1, *ids], []], ValueError, "block id -1 is negative"),
        ([ids + [2**70], []], TypeError, "must be ints"),
    ]
    for groups, exc, match in cases:
        with pytest.raises(exc, match=match):
            GroupedBlockIds(groups, lay)


@pytest.mark.parametrize("n", [0, 7, 255, 256, 257, 2000])
def test_grouped_ids_quick_and_full_check_agree(n: int) -> None:
    lay = synthetic_layout(num_layers=4, num_groups=3, num_blocks=4096, head_size=8)
    rng = np.random.default_rng(n)
    flat = rng.permutation(np.arange(1, 4096))[:n].tolist()
    groups = [[0, 0, *flat[: n // 3]], flat[n // 3 : n // 2], flat[n // 2 :]]
    quick = GroupedBlockIds(groups, lay)  # lists of Python ints: the quick check
    full = GroupedBlockIds([np.array(g, dtype=np.int64) for g in groups], lay)  # numpy
    trusted = GroupedBlockIds(groups, lay, trusted=True)
    for ids in (quick, full, trusted):
        assert ids.flat.tolist() == [b for g in groups for b in g]
        assert ids.group_sizes.tolist() == [len(g) for g in groups]
        assert ids.unique_ids().tolist() == sorted(flat)
        assert list(ids.sorted_ids()) == sorted(flat)
        assert len(ids) == n + 2 and ids.groups == groups
        assert not ids.flat.flags.writeable and not ids.unique_ids().flags.writeable


def test_grouped_ids_numpy_ints_in_lists_are_ids() -> None:
    ids = GroupedBlockIds([[np.int64(3), np.int32(4)], [5]], LAYOUT)
    assert ids.unique_ids().tolist() == [3, 4, 5]


def test_trusted_skips_per_id_checks_only() -> None:
    # the ids are taken as they are (a repeated id is moved once) ...
    ids = GroupedBlockIds([[3, 4, 3], []], LAYOUT, trusted=True)
    assert ids.unique_ids().tolist() == [3, 4]
    # ... but the shape of the input is still checked
    with pytest.raises(ValueError, match="expected 2 block-id lists"):
        GroupedBlockIds([[1]], LAYOUT, trusted=True)
    with pytest.raises(TypeError, match="got a flat list of ids"):
        GroupedBlockIds([1, 2], LAYOUT, trusted=True)
    with pytest.raises(TypeError, match="must be ints"):
        GroupedBlockIds([np.array([1.5]), []], LAYOUT, trusted=True)


# -- sliding-window clip ----------------------------------------------------------------------


def test_clip_to_window_keeps_last_33() -> None:
    lay = preset("gemma-3-1b", num_blocks=1024)
    fa_ids = list(range(1, 101))
    groups = [list(range(100 * g + 101, 100 * g + 201)) for g in range(6)] + [fa_ids]
    clipped = clip_to_window(groups, lay)
    # window 512, block 16: cdiv(512, 16) + 1 = 33 ids per SW group
    for g in range(6):
        assert clipped[g] == groups[g][-33:]
        assert len(clipped[g]) == 33
    assert clipped[6] == fa_ids  # full attention kept whole


def test_clip_short_and_empty_groups() -> None:
    lay = preset("gemma-3-1b", num_blocks=64)
    groups = [[0, 1, 2], [], [], [], [], [], []]
    assert clip_to_window(groups, lay) == groups
    with pytest.raises(ValueError, match="expected 7 id lists, got 1"):
        clip_to_window([[1]], lay)


def test_request_blocks_per_group() -> None:
    lay = preset("gemma-3-1b", num_blocks=64)
    assert request_blocks(lay, 2000) == [33] * 6 + [125]
    assert request_blocks(lay, 1) == [1] * 7


# -- bad input: block pool ------------------------------------------------------------

def test_block_pool_misuse() -> None:
    pool = ks.BlockPool(16)
    held = pool.allocate(5)
    pool.free(held[:2])
    before = pool_state(pool)
    with pytest.raises(ValueError, match="cannot allocate 20 blocks: only 12 of 15 are free"):
        pool.allocate(20)
    with pytest.raises(ValueError, match=r"not allocated \(or repeated\): \[1\]; each "
                       "allocated id is freed exactly once"):
        pool.free([held[2], held[0]])  # held[0] was freed already: nothing is freed
    with pytest.raises(ValueError, match="allocate\\(n\\) needs an int n >= 0, got -1"):
        pool.allocate(-1)
    assert pool_state(pool) == before


