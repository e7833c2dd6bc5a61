"""Planning (pure numpy): runs, chunking under a byte budget, descriptor counts per host
layout, and padding/owned bytes, all checked against exact numbers."""

from __future__ import annotations

import numpy as np
import pytest

from kvstage import GroupedBlockIds, HostBuffer, HostLayout, find_runs, plan_copy, preset
from kvstage.plan import INDEX_BYTES, split_runs
from kvstage.presets import synthetic_layout

KIB = 1024


def test_find_runs_merges_contiguous_pairs() -> None:
    assert find_runs([3, 4, 5, 9], [3, 4, 5, 9]).tolist() == [[3, 3, 3], [9, 9, 1]]


def test_find_runs_sorts_by_dst() -> None:
    assert find_runs([9, 3, 4, 5], [9, 3, 4, 5]).tolist() == [[3, 3, 3], [9, 9, 1]]


def test_find_runs_needs_both_sides_to_advance() -> None:
    # dst 10,11 pair with src 1,2 (one run); dst 3 pairs with src 7
    assert find_runs([1, 2, 7], [10, 11, 3]).tolist() == [[7, 3, 1], [1, 10, 2]]
    # dst contiguous but src not: two runs
    assert find_runs([5, 1], [1, 2]).tolist() == [[5, 1, 1], [1, 2, 1]]


def test_find_runs_empty_and_mismatch() -> None:
    assert find_runs([], []).shape == (0, 3)
    with pytest.raises(ValueError, match="src has 2 ids, dst has 1; they pair one to one"):
        find_runs([1, 2], [1])


def test_split_runs_exact_pieces_and_chunks() -> None:
    runs = np.array([[1, 1, 5], [10, 10, 3], [20, 20, 1]])
    pieces, chunks = split_runs(runs, 3)
    # 9 blocks in chunks of 3: [1,2,3] [4,5,10] [11,12,20]
    assert pieces.tolist() == [
        [1, 1, 3, 0],
        [4, 4, 2, 0],
        [10, 10, 1, 2],
        [11, 11, 2, 0],
        [20, 20, 1, 2],
    ]
    assert chunks.tolist() == [[0, 1], [1, 3], [3, 5]]


def test_split_runs_one_chunk_and_one_block_chunks() -> None:
    runs = np.array([[2, 2, 4]])
    pieces, chunks = split_runs(runs, 100)
    assert pieces.tolist() == [[2, 2, 4, 0]] and chunks.tolist() == [[0, 1]]
    pieces, chunks = split_runs(runs, 1)
    assert pieces.tolist() == [[2, 2, 1, 0], [3, 3, 1, 0], [4, 4, 1, 0], [5, 5, 1, 0]]
    assert chunks.tolist() == [[0, 1], [1, 2], [2, 3], [3, 4]]


def test_split_runs_empty_and_bad_len() -> None:
    pieces, chunks = split_runs(np.zeros((0, 3), np.int64), 4)
    assert pieces.shape == (0, 4) and chunks.shape == (0, 2)
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        split_runs(np.array([[1, 1, 1]]), 0)


@pytest.mark.parametrize("max_len", [1, 2, 3, 7, 64])
def test_split_runs_chunks_cover_request_in_order(max_len: int) -> None:
    rng = np.random.default_rng(max_len)
    ids = np.sort(rng.choice(np.arange(1, 200), size=50, replace=False))
    runs = find_runs(ids, ids)
    pieces, chunks = split_runs(runs, max_len)
    assert chunks.shape[0] == -(-50 // max_len)
    covered = np.concatenate([np.arange(s, s + n) for s, _, n, _ in pieces.tolist()])
    assert covered.tolist() == ids.tolist()
    for k, (first, end) in enumerate(chunks.tolist()):
        sizes = pieces[first:end, 2]
        assert sizes.sum() == min(max_len, 50 - k * max_len)
        # offsets inside a chunk are the running sum of the piece lengths
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        assert pieces[first:end, 3].tolist() == offsets.tolist()


GEMMA = preset("gemma-3-1b", num_blocks=256)
GEMMA_IDS = [[0, 0, 1, 2], [3, 4], [5], [6], [7, 8], [9, 10, 11], [12, 13, 14, 15]]


def test_plan_gemma_bytes_padding_owned() -> None:
    plan = plan_copy(GEMMA, GroupedBlockIds(GEMMA_IDS, GEMMA))
    assert plan.block_ids.tolist() == list(range(1, 16))
    assert plan.num_blocks == 15 and plan.num_runs == 1 and plan.num_chunks == 1
    assert plan.nbytes == 15 * 4 * 16 * KIB  # every tensor moves the whole id set
    # owned: groups 0-3 and 6 have 4 layers, groups 4 and 5 have 3 (no layer in tensor 3)
    # (2 + 2 + 1 + 1 + 4) * 4 + (2 + 3) * 3 = 55 slots
    assert plan.owned_slots == 55
    assert plan.owned_bytes == 55 * 16 * KIB
    assert plan.padding_bytes == 5 * 16 * KIB  # tensor-3 slots of groups 4 and 5
    assert plan.summary()["owned_bytes"] == plan.owned_bytes


def test_plan_chunk_blocks_from_budget() -> None:
    # gemma: 4 tensors x 16 KiB = 64 KiB rows; 8 MiB // (64 KiB + 8) = 127 blocks
    plan = plan_copy(GEMMA, GroupedBlockIds(GEMMA_IDS, GEMMA))
    assert plan.chunk_blocks == 127
    small = plan_copy(GEMMA, GroupedBlockIds(GEMMA_IDS, GEMMA), max_temp_bytes=4 * 64 * KIB)
    assert small.chunk_blocks == 3  # 262144 // 65544
    assert small.num_chunks == 5
    assert small.staging_bytes == 3 * (64 * KIB + INDEX_BYTES)
    tiny = plan_copy(GEMMA, GroupedBlockIds(GEMMA_IDS, GEMMA), max_temp_bytes=1)
    assert tiny.chunk_blocks == 1 and tiny.num_chunks == 15  # never 0 blocks per chunk
    for p in (plan, small, tiny):  # num_chunks needs no split; the lazy split agrees
        assert p.chunks.shape[0] == p.num_chunks
        assert int(p.pieces[:, 2].sum()) == p.num_blocks


@pytest.mark.parametrize("name", ["gemma-3-1b", "llama-3.1-8b", "gpt-oss-20b", "deepseek-v2-lite"])
def test_descriptor_counts_per_host_layout(name: str) -> None:
    lay = preset(name, num_blocks=48)
    flat = [1, 2, 3, 7, 8, 20, 40, 41]  # runs: 1-3, 7-8, 20, 40-41 = 4
    groups = [flat if g == 0 else [] for g in range(lay.num_groups)]
    plan = plan_copy(lay, GroupedBlockIds(groups, lay))
    assert plan.num_runs == 4
    assert plan.num_descriptors(block_major=True) == 4
    assert plan.num_descriptors(block_major=False) == 4 * lay.num_tensors * lay.num_planes
    # the host buffer's own descriptor rows agree and cover exactly the plan's bytes
    for host_layout, block_major in ((HostLayout.BLOCK_MAJOR, True), (HostLayout.MIRROR, False)):
        host = HostBuffer(lay, host_layout)
        desc = host.descriptors(plan.runs[:, 0], plan.runs[:, 2])
        assert desc.shape == (plan.num_descriptors(block_major), 2)
        assert int(desc[:, 1].sum()) == plan.nbytes
        del host


def test_descriptor_addresses_block_major_and_mirror() -> None:
    lay = synthetic_layout(num_layers=2, num_groups=1, num_blocks=8, block_size=1,
                           num_kv_heads=1, head_size=4)  # page 16 B, row 32 B
    bm = HostBuffer(lay, HostLayout.BLOCK_MAJOR)
    d = bm.descriptors(np.array([1, 5]), np.array([2, 1]))
    assert (d - [bm.data_ptr, 0]).tolist() == [[32, 64], [160, 32]]
    mirror = HostBuffer(lay, HostLayout.MIRROR)
    d = mirror.descriptors(np.array([1, 5]), np.array([2, 1]))
    # tensor-major: tensor 0 (base 0) then tensor 1 (base 8 blocks x 16 B = 128)
    assert (d - [mirror.data_ptr, 0]).tolist() == [[16, 32], [80, 16], [144, 32], [208, 16]]


def test_plan_empty_request() -> None:
    plan = plan_copy(GEMMA, GroupedBlockIds([[0, 0]] + [[]] * 6, GEMMA))
    assert plan.is_empty and plan.num_runs == 0 and plan.num_chunks == 0
    assert plan.nbytes == 0 and plan.staging_bytes == 0


def test_plan_errors() -> None:
    ids = GroupedBlockIds([[1]] + [[]] * 6, GEMMA)
    with pytest.raises(TypeError, match="expected GroupedBlockIds, got list"):
        plan_copy(GEMMA, [[1]] + [[]] * 6)  # type: ignore[arg-type]
    other = preset("gemma-3-1b", num_blocks=128)
    with pytest.raises(ValueError, match=r"7 groups x 256 blocks, the layout has 7 x 128"):
        plan_copy(other, ids)
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="max_temp_bytes must be a positive int"):
            plan_copy(GEMMA, ids, max_temp_bytes=bad)  # type: ignore[arg-type]


def test_plan_bool_budget_refused() -> None:
    ids = GroupedBlockIds([[1]] + [[]] * 6, GEMMA)
    with pytest.raises(ValueError, match="max_temp_bytes must be a positive int, got True"):
        plan_copy(GEMMA, ids, max_temp_bytes=True)


@pytest.mark.parametrize("n", [1, 5, 64, 255, 256, 300, 5000])
def test_runs_python_and_numpy_paths_agree(n: int) -> None:
    lay = synthetic_layout(num_layers=2, num_groups=1, num_blocks=20_000, head_size=8)
    rng = np.random.default_rng(n)
    ids = rng.choice(np.arange(1, 20_000), size=n, replace=False)
    ids[: n // 2] = np.arange(100, 100 + n // 2)  # one long run among scattered ids
    ids = np.unique(ids)
    want = find_runs(ids, ids).tolist()
    for groups in ([ids.tolist()], [ids]):  # Python ints (sets, loops) and numpy (diff)
        plan = plan_copy(lay, GroupedBlockIds(groups, lay))
        assert plan.runs.tolist() == want
        assert [list(r) for r in plan.run_list] == want
        assert plan.num_runs == len(want) and plan.num_blocks == ids.size
        assert plan.block_ids.tolist() == ids.tolist()


def test_plan_equality_is_by_content() -> None:
    a = plan_copy(GEMMA, GroupedBlockIds(GEMMA_IDS, GEMMA))
    b = plan_copy(GEMMA, GroupedBlockIds([np.array(g) for g in GEMMA_IDS], GEMMA))
    assert a == b and (a != b) is False  # numpy arrays inside never reach a bare ==
    assert a != plan_copy(GEMMA, GroupedBlockIds(GEMMA_IDS, GEMMA), max_temp_bytes=1 << 20)
    moved = [list(GEMMA_IDS[0]), *GEMMA_IDS[1:6], [12, 13, 14]]  # block 15 not moved
    assert a != plan_copy(GEMMA, GroupedBlockIds(moved, GEMMA))
    # same blocks, but group 4 (3 layers) holds them instead of group 6 (4): owned differs
    regrouped = [g if k not in (4, 6) else [] for k, g in enumerate(GEMMA_IDS)]
    regrouped[4] = [7, 8, 12, 13, 14, 15]
    assert plan_copy(GEMMA, GroupedBlockIds(regrouped, GEMMA)).runs.tolist() == a.runs.tolist()
    assert plan_copy(GEMMA, GroupedBlockIds(regrouped, GEMMA)) != a
    assert a != "plan" and "CopyPlan(blocks=15, runs=1" in repr(a)
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


@pytest.mark.parametrize("n", [0, 9, 300])
def test_runs_of_ids_equal_plan_copy_runs(n: int) -> None:
    """The connector's fast path gives the runs plan_copy gives for the same trusted ids
    (small lists in Python, large ones in numpy), null ids and order ignored."""
    from kvstage.plan import runs_of_ids

    layout = preset("gemma-3-1b", num_blocks=2 * n + 8)
    rng = np.random.default_rng(n)
    ids = [int(i) for i in rng.permutation(np.arange(1, 2 * n + 8))[:n]] + [0, 0]
    want = plan_copy(layout, GroupedBlockIds([ids] + [[]] * (layout.num_groups - 1), layout,
                                             trusted=True)).runs.tolist()
    got = runs_of_ids(ids)
    assert [list(r) for r in (got.tolist() if isinstance(got, np.ndarray) else got)] == want
    assert isinstance(got, np.ndarray) == (n + 2 > 256)
