"""Exact op counts (OpCounter on CPU) per strategy, and peak temporary bytes: fused staged
stays under its budget whatever the request size, fused direct allocates nothing,
coalesced grows with the request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage import CopyEngine, Direction, HostBuffer, HostLayout, KVCache, synthetic_layout
from kvstage.plan import INDEX_BYTES
from kvstage.testing.baselines import make_engine
from kvstage.testing.opcount import DATA_OPS, OpCounter

B = 24  # blocks per request: ids 1..24


def _engine(num_layers: int, groups: int, strategy: str, mode: str = "direct",
            **kw: int) -> CopyEngine:
    lay = synthetic_layout(num_layers=num_layers, num_groups=groups, num_blocks=64,
                           num_kv_heads=1, head_size=8)
    return make_engine(KVCache(lay), HostBuffer(lay), strategy, mode=mode,  # type: ignore[arg-type]
                      **kw)


def _split(ids: list[int], g: int) -> list[list[int]]:
    return [ids[k::g] for k in range(g)]


def _count(engine: CopyEngine, groups: list[list[int]], direction: Direction) -> dict[str, int]:
    with OpCounter() as counter:
        engine.copy(groups, direction)
    return counter.data_counts()


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize("g", [1, 2, 3, 6])
def test_op_counts_16_layers(g: int, direction: Direction) -> None:
    groups = _split(list(range(1, B + 1)), g)
    # per_group: G calls x 16 layer names x 2 ops (CPU `index` gather + `index_put_`)
    assert _count(_engine(16, g, "per_group"), groups, direction) == {
        "index": g * 16, "index_put_": g * 16,
    }  # G=1: 32 ops, G=2: 64, G=3: 96, G=6: 192
    # coalesced: one call over the concatenated ids: 16 x 2 = 32 ops whatever G
    assert _count(_engine(16, g, "coalesced"), groups, direction) == {
        "index": 16, "index_put_": 16,
    }
    # fused direct: ids 1..24 are one run: exactly ONE copy_ for every tensor and plane
    assert _count(_engine(16, g, "fused"), groups, direction) == {"copy_": 1}


@pytest.mark.parametrize("num_layers", [16, 48])
@pytest.mark.parametrize("g", [1, 3])
def test_fused_independent_of_layers_and_groups(num_layers: int, g: int) -> None:
    groups = _split(list(range(1, B + 1)), g)
    assert _count(_engine(num_layers, g, "fused"), groups, Direction.D2H) == {"copy_": 1}
    assert _count(_engine(num_layers, g, "coalesced"), groups, Direction.D2H) == {
        "index": num_layers, "index_put_": num_layers,
    }


def test_fused_scattered_ids_one_copy_per_run() -> None:
    ids = [1, 2, 3, 9, 10, 20, 30, 31, 32, 33, 50]  # runs: 1-3, 9-10, 20, 30-33, 50
    groups = [[ids[i] for i in order] for order in ([0, 5, 8], [3, 1, 10], [2, 4, 6, 7, 9])]
    for direction in Direction:
        assert _count(_engine(16, 3, "fused"), groups, direction) == {"copy_": 5}


def test_empty_group_adds_nothing() -> None:
    # per_group skips an empty group (vLLM's copy_kv_blocks returns early on [])
    with_empty = [[1, 2, 3], [], [4, 5]]
    assert _count(_engine(6, 3, "per_group"), with_empty, Direction.D2H) == {
        "index": 2 * 6, "index_put_": 2 * 6,
    }
    assert _count(_engine(6, 3, "coalesced"), with_empty, Direction.D2H) == {
        "index": 6, "index_put_": 6,
    }
    assert _count(_engine(6, 3, "fused"), with_empty, Direction.D2H) == {"copy_": 1}


@pytest.mark.parametrize("strategy", ["per_group", "coalesced", "fused"])
@pytest.mark.parametrize("mode", ["direct", "staged"])
def test_all_empty_does_nothing(strategy: str, mode: str) -> None:
    engine = _engine(16, 2, strategy, mode)
    for direction in Direction:
        with OpCounter() as counter:
            stats = engine.copy([[], []], direction)
        assert counter.data_ops == 0 and counter.total_alloc_bytes == 0
        assert sum(counter.counts.values()) == 0  # not even a view or an index upload
        assert stats.blocks == 0


def test_fused_null_only_does_nothing() -> None:
    with OpCounter() as counter:
        _engine(16, 2, "fused").save_to_host([[0, 0], [0]])
    assert counter.data_ops == 0


@pytest.mark.parametrize("host_layout", list(HostLayout), ids=lambda h: h.value)
def test_fused_staged_counts(host_layout: HostLayout) -> None:
    lay = synthetic_layout(num_layers=16, num_groups=2, num_blocks=64, num_kv_heads=1,
                           head_size=8)
    engine = CopyEngine(KVCache(lay), HostBuffer(lay, host_layout), mode="staged",
                        max_temp_bytes=5 * (lay.block_bytes + INDEX_BYTES))
    ids = [1, 2, 3, 4, 5, 6, 7, 20, 21, 22, 40]  # runs 1-7, 20-22, 40
    groups = [ids[::2], ids[1::2]]
    plan = engine.plan(groups)
    # 11 blocks in chunks of 5: [1-5] [6,7,20,21,22] [40] -> pieces 1-5 | 6-7, 20-22 | 40
    assert plan.num_chunks == 3 and plan.pieces.shape[0] == 4
    # d2h: one index_select gather per chunk + one copy_ per run piece
    assert _count(engine, groups, Direction.D2H) == {"index_select": 3, "copy_": 4}
    # h2d: one copy_ per run piece into staging + one index_copy_ scatter per chunk
    assert _count(engine, groups, Direction.H2D) == {"index_copy_": 3, "copy_": 4}


def test_op_counter_counts_data_ops_only() -> None:
    with OpCounter() as counter:
        x = torch.zeros(4)
        x.view(2, 2).copy_(torch.ones(2, 2))
    assert counter.data_counts() == {"copy_": 1}
    assert counter.counts["view"] == 1
    assert "view" not in DATA_OPS and counter.data_ops == 1


# -- peak temporary bytes ---------------------------------------------------------------------

SIZES = [1, 10, 100, 1000, 10_000]
# 2 layers, 1 group, page 2 x 1 x 1 x 4 x 2 = 16 B, block row 32 B: 10,002 blocks = 320 KB
BIG = synthetic_layout(num_layers=2, num_groups=1, num_blocks=10_002, block_size=1,
                       num_kv_heads=1, head_size=4)
BUDGET = 1000  # bytes -> 1000 // (32 + 8) = 25 blocks per chunk


@pytest.fixture(scope="module")
def big_pair() -> tuple[KVCache, HostBuffer]:
    cache = KVCache(BIG)
    cache.fill_random(5)
    return cache, HostBuffer(BIG)


def _ids(n: int, scattered: bool) -> list[list[int]]:
    ids = np.arange(1, n + 1)
    if scattered:
        ids = np.random.default_rng(n).choice(np.arange(1, BIG.num_blocks), n, replace=False)
    return [ids.tolist()]


def _peak(engine: CopyEngine, groups: list[list[int]], direction: Direction) -> OpCounter:
    with OpCounter() as counter:
        engine.copy(groups, direction)
    return counter


@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_staged_peak_within_budget(
    big_pair: tuple[KVCache, HostBuffer], direction: Direction, scattered: bool
) -> None:
    engine = CopyEngine(*big_pair, mode="staged", max_temp_bytes=BUDGET)
    peaks = []
    for n in SIZES:
        counter = _peak(engine, _ids(n, scattered), direction)
        assert counter.peak_temp_bytes <= BUDGET + BIG.block_bytes, (n, counter.peak_temp_bytes)
        assert counter.peak_temp_bytes > 0  # the staging buffer is seen
        peaks.append(counter.peak_temp_bytes)
    # flat: from 25 blocks on, the staging buffer is a fixed 25 rows
    assert peaks[2:] == [25 * BIG.block_bytes] * 3


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_direct_allocates_nothing(big_pair: tuple[KVCache, HostBuffer],
                                  direction: Direction) -> None:
    engine = CopyEngine(*big_pair, mode="direct")
    for n in SIZES:
        for scattered in (False, True):
            counter = _peak(engine, _ids(n, scattered), direction)
            assert counter.peak_temp_bytes == 0 and counter.total_alloc_bytes == 0


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_coalesced_peak_grows_with_request(big_pair: tuple[KVCache, HostBuffer],
                                           direction: Direction) -> None:
    engine = make_engine(*big_pair, "coalesced")
    peaks = []
    for n in SIZES:
        counter = _peak(engine, _ids(n, scattered=False), direction)
        # each layer's gather materialises n pages before scattering them
        assert counter.peak_temp_bytes >= n * BIG.page_size_bytes
        peaks.append(counter.peak_temp_bytes)
    assert all(a < b for a, b in zip(peaks, peaks[1:], strict=False)), peaks
    assert peaks[-1] >= 10_000 * 16 > BUDGET * 100


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_fused_direct_issues_one_copy_per_run_and_nothing_else(
    direction: Direction, trusted: bool
) -> None:
    engine = _engine(16, 3, "fused")
    ids = [1, 2, 3, 9, 10, 20, 30, 31, 32, 33, 50]  # 5 runs
    groups = [ids[0::3], ids[1::3], ids[2::3]]
    with OpCounter() as counter:
        engine.copy(groups, direction, trusted=trusted)
    # per run: two views (aten.slice, from narrow) and one copy_; no index upload, no
    # temporary, no other op
    assert dict(counter.counts) == {"copy_": 5, "slice": 10}
    assert counter.total_alloc_bytes == 0


def test_fused_direct_per_tensor_when_not_a_slab() -> None:
    lay = synthetic_layout(num_layers=4, num_groups=2, num_blocks=64, num_kv_heads=1,
                           head_size=8)
    tensors = [torch.zeros(lay.num_blocks, lay.plane_elems, dtype=lay.torch_dtype)
               for _ in range(lay.num_tensors)]
    engine = CopyEngine(KVCache.wrap(lay, tensors), HostBuffer(lay))
    with OpCounter() as counter:
        engine.copy([[1, 2, 3], [7]], Direction.H2D)
    # 2 runs x 2 separate physical tensors
    assert dict(counter.counts) == {"copy_": 4, "slice": 8}


# a real call for every name in DATA_OPS: a name no call can produce would make
# `data_ops` silently under-count
_X = torch.arange(24.0).reshape(6, 4)
_I = torch.tensor([0, 2])
DATA_OP_CALLS = {
    "copy_": lambda: torch.empty(6, 4).copy_(_X),
    "_to_copy": lambda: _X.to(torch.float64),
    "index": lambda: _X[_I],
    "index_put_": lambda: _X.clone().__setitem__(_I, 0.0),
    "index_select": lambda: _X.index_select(0, _I),
    "index_copy_": lambda: _X.clone().index_copy_(0, _I, _X[:2]),
    "index_copy": lambda: torch.index_copy(_X, 0, _I, _X[:2]),
    "gather": lambda: torch.gather(_X, 0, torch.zeros(2, 4, dtype=torch.long)),
    "scatter_": lambda: _X.clone().scatter_(0, torch.zeros(2, 4, dtype=torch.long), _X[:2]),
    "clone": lambda: _X.t().contiguous(),  # contiguous() reaches dispatch as clone
}


def test_every_data_op_name_is_reachable() -> None:
    assert set(DATA_OP_CALLS) == DATA_OPS
    for name, call in DATA_OP_CALLS.items():
        with OpCounter() as counter:
            call()
        assert counter.counts[name] >= 1, (name, dict(counter.counts))
