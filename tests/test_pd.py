"""Prefill -> decode in one process over the loopback transport (fast, no NIXL).

Prefill is served from a daemon thread that calls `serve_once` in a loop; the test
talks to it only through the side channel (as a decode worker would), so the two
never touch each other's state. Byte checks regenerate the pattern on the decode side
(`verify_request`); descriptor counts are checked against runs counted here by hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pytest

from kvstage.cache import HostLayout
from kvstage.layout import CacheLayout, KVLayout
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker, pair_runs
from kvstage.pd.prefill import PrefillWorker
from kvstage.pd.side_channel import PeerError
from kvstage.presets import preset, synthetic_layout
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import make_decode, make_prefill
from pd_helpers import serving

NUM_BLOCKS = 1024
GEMMA = preset("gemma-3-1b", num_blocks=NUM_BLOCKS)


@contextmanager
def pair(
    layout: KVLayout = GEMMA,
    *,
    host_layout: HostLayout = HostLayout.BLOCK_MAJOR,
    decode_layout: KVLayout | None = None,
    decode_host_layout: HostLayout | None = None,
    lease_s: float = 30.0,
) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = make_prefill(layout, host_layout=host_layout, lease_s=lease_s,
                            transport="loopback")
    with serving(prefill):
        decode = make_decode(decode_layout or layout, transport="loopback",
                              host_layout=decode_host_layout or host_layout,
                              read_timeout_s=min(5.0, lease_s / 2), handshake_timeout_s=2.0)
        try:
            yield prefill, decode
        finally:
            decode.close()


def remote_prefill(decode: DecodeWorker, addr: tuple[str, int], rid: str, tokens: int,
                   seed: int) -> m.PrefillDone:
    done = decode.client(*addr).call(m.PrefillRequest(request_id=rid, num_tokens=tokens,
                                                      seed=seed))
    assert isinstance(done, m.PrefillDone)
    return done


def remote_stats(decode: DecodeWorker, addr: tuple[str, int]) -> m.Stats:
    stats = decode.client(*addr).call(m.GetStats())
    assert isinstance(stats, m.Stats)
    return stats


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def count_runs(remote: Sequence[Sequence[int]], local: Sequence[Sequence[int]]) -> int:
    """Runs where both ids advance by one, counted the slow, obvious way."""
    pairs = sorted((b, a) for r, loc in zip(remote, local, strict=True)
                   for a, b in zip(r, loc, strict=True) if a)
    runs = 0
    for i, (dst, src) in enumerate(pairs):
        if i == 0 or (dst, src) != (pairs[i - 1][0] + 1, pairs[i - 1][1] + 1):
            runs += 1
    return runs


def transfer(decode: DecodeWorker, addr: tuple[str, int], rid: str, tokens: int, seed: int,
             local: list[list[int]] | None = None):
    done = remote_prefill(decode, addr, rid, tokens, seed)
    res = decode.start(rid, addr, done.block_ids, local)
    if res.status == "pending":
        res = decode.wait(rid, 10.0)
    return done, res


def assert_clean(decode: DecodeWorker) -> None:
    assert decode.pool.num_free == decode.layout.num_blocks - 1
    assert decode.transport.num_open_handles == 0
    assert decode.num_pending == 0 and decode.num_draining == 0


# -- byte-exact transfers -----------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("host_layout", list(HostLayout), ids=lambda h: h.value)
@pytest.mark.parametrize(
    "cache_layout", [CacheLayout.PACKED, CacheLayout.KV_SPLIT], ids=lambda c: c.value
)
def test_hybrid_transfer_is_byte_exact(host_layout: HostLayout,
                                       cache_layout: CacheLayout) -> None:
    layout = preset("gemma-3-1b", num_blocks=NUM_BLOCKS, cache_layout=cache_layout)
    with pair(layout, host_layout=host_layout) as (prefill, decode):
        addr = prefill.address
        for i, tokens in enumerate([512, 4096]):
            rid = f"r{i}"
            done, res = transfer(decode, addr, rid, tokens, seed=7 + i)
            assert res.status == "done", res.reason
            assert [len(g) for g in res.local_block_ids] == [len(g) for g in done.block_ids]
            assert verify_request(decode.cache, res.local_block_ids, 7 + i) == []
            assert res.nbytes == sum(map(len, done.block_ids)) * layout.block_bytes
            decode.finish(rid)
        wait_for(lambda: remote_stats(decode, addr).completed == 2)
        stats = remote_stats(decode, addr)
        assert stats.held_requests == 0 and stats.free_blocks == NUM_BLOCKS - 1
        assert stats.unknown_notifs == []
        assert_clean(decode)


def test_pair_runs_end_aligns_a_held_prefix() -> None:
    # decode holds the first block of group 0: only the last two remote ids are paired
    runs = pair_runs([[5, 6, 7], [9]], [[20, 21], [30]])
    assert runs.tolist() == [[6, 20, 2], [9, 30, 1]]


# -- descriptor counts --------------------------------------------------------------------
def _scattered_local(done: m.PrefillDone) -> list[list[int]]:
    """Every other id from the top of the pool: no two pairs form a run."""
    ids = iter(range(NUM_BLOCKS - 1, 0, -2))
    return [[next(ids) for _ in g] for g in done.block_ids]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host_layout", list(HostLayout), ids=lambda h: h.value)
@pytest.mark.parametrize("ids", ["contiguous", "scattered", "churned"])
def test_descriptor_count_is_runs(host_layout: HostLayout, ids: str) -> None:
    lay = GEMMA
    per_run = 1 if host_layout is HostLayout.BLOCK_MAJOR else lay.num_tensors * lay.num_planes
    with pair(lay, host_layout=host_layout) as (prefill, decode):
        addr = prefill.address
        if ids == "churned":
            # churn the prefill pool: its free queue now hands out ids in pieces
            for i, tokens in enumerate([300, 700, 200, 900]):
                remote_prefill(decode, addr, f"c{i}", tokens, seed=i)
            for i in (0, 2):
                decode.client(*addr).call(m.Release(request_id=f"c{i}"))
        done = remote_prefill(decode, addr, "req", 4096, seed=3)
        local = _scattered_local(done) if ids == "scattered" else None
        for g in local or []:
            decode.pool.claim(g)  # the caller allocates the ids it passes
        res = decode.start("req", addr, done.block_ids, local)
        if res.status == "pending":
            res = decode.wait("req", 10.0)
        assert res.status == "done", res.reason
        runs = count_runs(done.block_ids, res.local_block_ids)
        blocks = sum(map(len, done.block_ids))
        if ids == "contiguous":
            assert runs == 1
        elif ids == "scattered":
            assert runs == blocks
        else:
            assert 1 < runs < blocks
        assert res.num_runs == runs
        assert res.num_descriptors == runs * per_run
        assert verify_request(decode.cache, res.local_block_ids, 3) == []
        if local is None:
            decode.finish("req")
        for g in local or []:
            decode.pool.free(g)
        assert_clean(decode)


# -- handshake refusals -------------------------------------------------------------------
def _synthetic(**kw: object) -> KVLayout:
    base: dict[str, object] = dict(num_layers=8, num_groups=2, num_blocks=64)
    return synthetic_layout(**(base | kw))  # type: ignore[arg-type]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("decode_kw", "field"),
    [
        ({"num_blocks": 128}, "num_blocks"),
        ({"block_size": 32, "head_size": 64}, "block_size"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"num_kv_heads": 8, "head_size": 64}, "num_kv_heads"),
        ({"num_groups": 4}, "num_groups"),
        ({"num_layers": 10}, "layers"),
    ],
)
def test_layout_mismatch_is_refused_naming_the_field(decode_kw: dict[str, object],
                                                     field: str) -> None:
    with pair(_synthetic(), decode_layout=_synthetic(**decode_kw)) as (prefill, decode):
        with pytest.raises(ValueError, match=f"incompatible KV layout.*{field}"):
            decode.connect(*prefill.address)
        # a refused request leaves nothing behind on either side
        ids = [[g + 1] for g in range(decode.layout.num_groups)]
        res = decode.start("r", prefill.address, ids)
        assert res.status == "failed" and field in res.reason
        assert_clean(decode)


@pytest.mark.timeout(30)
def test_host_layout_mismatch_is_refused() -> None:
    with pair(_synthetic(), host_layout=HostLayout.BLOCK_MAJOR,
              decode_host_layout=HostLayout.MIRROR) as (prefill, decode), \
            pytest.raises(ValueError, match="host_layout is 'mirror' here, 'block_major'"):
        decode.connect(*prefill.address)


# -- failures, leases, unknown ids ----------------------------------------------------------
@pytest.mark.timeout(30)
def test_released_before_read_fails_naming_it_and_cleans_up() -> None:
    with pair() as (prefill, decode):
        addr = prefill.address
        done = remote_prefill(decode, addr, "gone", 512, seed=1)
        assert isinstance(decode.client(*addr).call(m.Release(request_id="gone")), m.Ok)
        res = decode.start("gone", addr, done.block_ids)
        assert res.status == "failed"
        assert "Acquire" in res.reason and "'gone' is not held" in res.reason
        assert_clean(decode)
        _, ok = transfer(decode, addr, "next", 512, seed=2)
        assert ok.status == "done" and verify_request(decode.cache, ok.local_block_ids, 2) == []
        decode.finish("next")
        assert_clean(decode)


@pytest.mark.timeout(30)
def test_lease_expiry_frees_prefill_blocks() -> None:
    with pair(lease_s=0.3) as (prefill, decode):
        addr = prefill.address
        done = remote_prefill(decode, addr, "late", 1024, seed=1)
        held = sum(map(len, done.block_ids))
        assert remote_stats(decode, addr).held_blocks == held
        wait_for(lambda: remote_stats(decode, addr).expired == 1)
        stats = remote_stats(decode, addr)
        assert stats.held_requests == 0 and stats.free_blocks == NUM_BLOCKS - 1
        res = decode.start("late", addr, done.block_ids)
        assert res.status == "failed" and "lease expired" in res.reason
        assert_clean(decode)


@pytest.mark.timeout(30)
def test_unknown_ids_are_reported_not_crashed_on() -> None:
    with pair() as (prefill, decode):
        addr = prefill.address
        remote = decode.connect(*addr)
        decode.transport.send_notif(remote.peer, b"no-such-request")
        wait_for(lambda: remote_stats(decode, addr).unknown_notifs == ["no-such-request"])
        with pytest.raises(PeerError, match="'nope' is not held"):
            decode.client(*addr).call(m.Acquire(request_id="nope"))
        with pytest.raises(PeerError, match="'nope' is not held"):
            decode.client(*addr).call(m.Release(request_id="nope"))
        # the worker still serves
        _, res = transfer(decode, addr, "after", 512, seed=5)
        assert res.status == "done"
        decode.finish("after")
