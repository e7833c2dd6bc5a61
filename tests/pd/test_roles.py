"""Prefill -> decode in one process over the loopback transport (fast, no NIXL).

Prefill is served from a daemon thread that calls `serve_once` in a loop; the test
talks to it only through the side channel (as a decode worker would), so the two
never touch each other's state. Byte checks regenerate the pattern on the decode side
(`verify_request`); descriptor counts are checked against runs counted here by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import kvstage as ks
from kvstage.cache import HostLayout
from kvstage.layout import CacheLayout, KVLayout
from kvstage.pd import auth
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker, pair_runs
from kvstage.pd.prefill import PrefillWorker
from kvstage.pd.side_channel import PeerError, SideChannelClient, parse_address, send_raw
from kvstage.presets import preset, synthetic_layout
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillThread, make_decode, make_prefill
from kvstage.transport import LoopbackTransport
from tests.helpers import pool_state, prefill_request, raw_bytes, wait_for
from tests.pd.test_messages import GARBLED

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
    with PrefillThread(prefill):
        decode = make_decode(decode_layout or layout, transport="loopback",
                              host_layout=decode_host_layout or host_layout,
                              read_timeout_s=min(5.0, lease_s / 2), handshake_timeout_s=2.0)
        try:
            yield prefill, decode
        finally:
            decode.close()





def remote_stats(decode: DecodeWorker, addr: tuple[str, int]) -> m.Stats:
    stats = decode.client(*addr).call(m.GetStats())
    assert isinstance(stats, m.Stats)
    return stats


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
    done = prefill_request(addr, rid, tokens, seed)
    res = decode.start(rid, addr, done.block_ids, local, capability=done.capability)
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
            churn = [prefill_request(addr, f"c{i}", tokens, seed=i)
                     for i, tokens in enumerate([300, 700, 200, 900])]
            for i in (0, 2):
                decode.client(*addr).call(m.Release(request_id=f"c{i}",
                                                    capability=churn[i].capability))
        done = prefill_request(addr, "req", 4096, seed=3)
        local = _scattered_local(done) if ids == "scattered" else None
        for g in local or []:
            decode.pool.claim(g)  # the caller allocates the ids it passes
        res = decode.start("req", addr, done.block_ids, local, capability=done.capability)
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
        done = prefill_request(addr, "gone", 512, seed=1)
        release = m.Release(request_id="gone", capability=done.capability)
        assert isinstance(decode.client(*addr).call(release), m.Ok)
        res = decode.start("gone", addr, done.block_ids, capability=done.capability)
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
        done = prefill_request(addr, "late", 1024, seed=1)
        held = sum(map(len, done.block_ids))
        assert remote_stats(decode, addr).held_blocks == held
        wait_for(lambda: remote_stats(decode, addr).expired == 1)
        stats = remote_stats(decode, addr)
        assert stats.held_requests == 0 and stats.free_blocks == NUM_BLOCKS - 1
        res = decode.start("late", addr, done.block_ids, capability=done.capability)
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


# -- bad input: P/D fixtures ----------------------------------------------------------

LAYOUT = ks.preset("gemma-3-1b", num_blocks=256, block_size=16)


@contextlib.contextmanager
def serving(layout: ks.KVLayout = LAYOUT, **kwargs: Any) -> Iterator[PrefillThread]:
    server = PrefillThread(make_prefill(layout, transport="loopback", **kwargs))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prefill() -> Iterator[PrefillThread]:
    with serving(lease_s=5.0) as server:
        yield server


@pytest.fixture
def decode() -> Iterator[DecodeWorker]:
    with make_decode(LAYOUT, transport="loopback", read_timeout_s=2.0,
                      handshake_timeout_s=5.0) as worker:
        yield worker


def respec(**changes: Any) -> ks.KVLayout:
    """LAYOUT with every group's spec changed the same way (page size kept equal)."""
    groups = tuple(
        ks.KVGroup(group_id=g.group_id, layer_names=g.layer_names,
                   spec=dataclasses.replace(g.spec, **changes))
        for g in LAYOUT.groups
    )
    return ks.KVLayout(num_blocks=LAYOUT.num_blocks, groups=groups, name=LAYOUT.name)


def stats(addr: tuple[str, int]) -> m.Stats:
    reply = SideChannelClient(*addr).call(m.GetStats())
    assert isinstance(reply, m.Stats)
    return reply


def raw_call(addr: tuple[str, int], payload: bytes) -> m.Message:
    reply = send_raw(*addr, payload, timeout_s=5.0)
    assert reply is not None, "prefill did not answer a garbled message"
    return auth.Authenticator(None).open_reply(reply, None)


@dataclass
class DecodeState:
    free: list[int]
    used: list[int]
    pending: int
    owned: dict[str, list[list[int]]]
    handles: int
    remotes: int
    host: torch.Tensor
    cache: torch.Tensor


def decode_state(d: DecodeWorker) -> DecodeState:
    free, used = pool_state(d.pool)
    return DecodeState(free, used, d.num_pending, {k: list(v) for k, v in d._owned.items()},
                       d.transport.num_open_handles, len(d._remotes), raw_bytes(d.host.storage),
                       raw_bytes(d.cache.slab))


def assert_decode_unchanged(d: DecodeWorker, before: DecodeState, *, order: bool = True) -> None:
    """``order=False``: the same free ids, maybe requeued (a failed request that allocated
    and gave its blocks back moves them to the tail of the free queue)."""
    after = decode_state(d)
    if order:
        assert (after.free, after.used) == (before.free, before.used), "decode pool changed"
    else:
        assert sorted(after.free) == sorted(before.free) and after.used == before.used
    assert after.pending == before.pending and after.owned == before.owned
    assert after.handles == before.handles and after.remotes == before.remotes
    assert torch.equal(after.host, before.host) and torch.equal(after.cache, before.cache)




# -- bad input: P/D bad input ---------------------------------------------------------

def test_garbled_message_to_live_prefill(prefill: PrefillThread) -> None:
    addr = prefill.address
    before = stats(addr)
    pool_before = pool_state(prefill.worker.pool)
    host_before = raw_bytes(prefill.worker.host.storage)
    for name, payload in sorted(GARBLED.items()):
        reply = raw_call(addr, payload)
        assert isinstance(reply, m.Error), name
        assert ("is not a kvstage message" in reply.message
                or "malformed side-channel message" in reply.message), reply.message
    reply = raw_call(addr, msgspec.msgpack.encode({"type": "get_stats", "version": 99}))
    assert isinstance(reply, m.Error) and "protocol version 99" in reply.message
    assert stats(addr) == before  # still serving, nothing changed
    assert pool_state(prefill.worker.pool) == pool_before
    assert torch.equal(raw_bytes(prefill.worker.host.storage), host_before)
    done = SideChannelClient(*addr).call(m.PrefillRequest(request_id="after", num_tokens=32,
                                                          seed=1))
    assert isinstance(done, m.PrefillDone)


@pytest.mark.parametrize(
    ("remote", "expected"),
    [
        (ks.preset("gemma-3-1b", num_blocks=512), "num_blocks is 256 here, 512 remote"),
        (ks.preset("gemma-3-1b", num_blocks=256, block_size=32),
         "group 0 block_size is 16 here, 32 remote"),
        (ks.preset("gemma-3-1b", num_blocks=256, cache_layout=ks.CacheLayout.KV_SPLIT),
         "cache_layout is <CacheLayout.PACKED: 'packed'> here, <CacheLayout.KV_SPLIT"),
        (ks.preset("gpt-oss-20b", num_blocks=256), "num_groups is 7 here, 2 remote"),
        (ks.KVLayout(num_blocks=256, name="gemma-3-1b", groups=tuple(
            ks.KVGroup(group_id=g.group_id, layer_names=g.layer_names,
                       spec=ks.FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256))
            for g in LAYOUT.groups)), "group 0 spec is SlidingWindowSpec here, FullAttentionSpec"),
        (respec(dtype="float16"), "group 0 dtype is 'bfloat16' here, 'float16' remote"),
        (respec(head_size=128), "group 0 head_size is 256 here, 128 remote"),
    ],
    ids=["num_blocks", "block_size", "cache_layout", "num_groups", "spec-kind", "dtype",
         "head_size"],
)
def test_remote_layout_differs_in_one_field(
    decode: DecodeWorker, remote: ks.KVLayout, expected: str
) -> None:
    with serving(remote, lease_s=5.0) as server:
        before = decode_state(decode)
        peers = set(decode.transport._peers)  # type: ignore[attr-defined]
        with pytest.raises(ValueError) as err:
            decode.connect(*server.address)
        assert "incompatible KV layout" in str(err.value)
        assert expected in str(err.value)
        assert_decode_unchanged(decode, before)
        assert set(decode.transport._peers) == peers  # type: ignore[attr-defined]
        # start() on that remote ends failed with the same reason, nothing allocated
        res = decode.start("r", server.address, [[g + 1] for g in range(7)])
        assert res.status == "failed" and expected in res.reason
        assert_decode_unchanged(decode, before, order=False)


def test_remote_host_layout_or_lease_mismatch(decode: DecodeWorker) -> None:
    before = decode_state(decode)
    with serving(host_layout=ks.HostLayout.MIRROR) as server, pytest.raises(
        ValueError, match="host_layout is 'block_major' here, 'mirror' remote; start both "
        "sides with the same one"
    ):
        decode.connect(*server.address)
    with serving(lease_s=1.0) as server, pytest.raises(
        ValueError, match=r"read_timeout_s \(2.0\) must be below the prefill lease \(1.0 s\)"
    ):
        decode.connect(*server.address)
    assert_decode_unchanged(decode, before)


def test_descriptors_beyond_a_registered_region() -> None:
    buf_a = torch.arange(4096, dtype=torch.int32).view(torch.uint8)[:8192].clone()
    buf_b = torch.zeros(8192, dtype=torch.uint8)
    with LoopbackTransport("bad-a") as a, LoopbackTransport("bad-b") as b:
        a.register_tensor(buf_a)
        b.register_tensor(buf_b)
        peer = b.add_peer(a.metadata())
        base_a, base_b = buf_a.data_ptr(), buf_b.data_ptr()

        def d(addr: int, n: int) -> np.ndarray:
            return np.array([[addr, n]], dtype=np.int64)

        before = buf_b.clone()
        with pytest.raises(ValueError) as err:
            b.read(peer, d(base_b, 4096), d(base_a + 6144, 4096), b"n")  # 2 KiB past the end
        msg = str(err.value)
        assert f"remote (peer 'bad-a') descriptor 0 (addr={base_a + 6144:#x}, nbytes=4096)" in msg
        assert f"registered remote (peer 'bad-a') regions: [{base_a:#x}, +8192)" in msg
        with pytest.raises(ValueError, match="local descriptor 0 .* is not inside any "
                           "registered region"):
            b.read(peer, d(base_b + 8192, 16), d(base_a, 16), b"n")
        with pytest.raises(ValueError, match="got 1 local and 2 remote descriptors"):
            b.read(peer, d(base_b, 16), np.array([[base_a, 8], [base_a + 8, 8]], np.int64), b"n")
        assert b.num_open_handles == 0 and a.get_notifs() == []
        assert torch.equal(buf_b, before)


def test_prefill_request_id_reused_while_in_flight(prefill: PrefillThread) -> None:
    client = SideChannelClient(*prefill.address)
    first = client.call(m.PrefillRequest(request_id="dup", num_tokens=64, seed=1))
    assert isinstance(first, m.PrefillDone)
    before = stats(prefill.address)
    host_before = raw_bytes(prefill.worker.host.storage)
    with pytest.raises(PeerError, match="request id 'dup' is still held \\(in flight\\); use a "
                       "new id or wait until decode has read it"):
        client.call(m.PrefillRequest(request_id="dup", num_tokens=16, seed=2))
    assert stats(prefill.address) == before
    assert torch.equal(raw_bytes(prefill.worker.host.storage), host_before)


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [(0, "num_tokens must be a positive int, got 0"),
     (-5, "num_tokens must be a positive int, got -5"),
     (10**6, "a 1000000-token prompt needs 62698 blocks, only 255 are free")],
    ids=["zero", "negative", "too-large"],
)
def test_prefill_bad_prompt_length(prefill: PrefillThread, tokens: int, expected: str) -> None:
    before = stats(prefill.address)
    with pytest.raises(PeerError) as err:
        SideChannelClient(*prefill.address).call(
            m.PrefillRequest(request_id="bad", num_tokens=tokens, seed=1))
    assert expected in str(err.value)
    assert stats(prefill.address) == before


def test_decode_request_id_reused_while_in_flight(
    prefill: PrefillThread, decode: DecodeWorker
) -> None:
    addr = prefill.address
    client = SideChannelClient(*addr)
    done = client.call(m.PrefillRequest(request_id="dup", num_tokens=64, seed=1))
    assert isinstance(done, m.PrefillDone)
    decode.transport.stall_reads = True  # type: ignore[attr-defined]  # keep it in flight
    first = decode.start("dup", addr, done.block_ids, capability=done.capability)
    assert first.status == "pending"
    before = decode_state(decode)
    prefill_before = stats(addr)
    with pytest.raises(ValueError, match="request id 'dup' is already in flight here; finish "
                       "or abort it first, or use a new id"):
        decode.start("dup", addr, done.block_ids, capability=done.capability)
    assert_decode_unchanged(decode, before)
    assert stats(addr) == prefill_before
    assert decode.abort("dup").status == "aborted"


def test_decode_bad_remote_or_local_ids(prefill: PrefillThread, decode: DecodeWorker) -> None:
    addr = prefill.address
    before = decode_state(decode)
    bad: list[tuple[Any, Any, str]] = [
        ([[300]] + [[]] * 6, None, "block id 300 is out of range: ids must be in [0, 256)"),
        ([[5], [5]] + [[]] * 5, None, "block id 5 appears in groups [0, 1]"),
        ([[5]] * 3, None, "expected 7 block-id lists"),
        ([[5]] + [[]] * 6, [[7, 8]] + [[]] * 6, "group 0: 2 local blocks for 1 remote ones; "
                                                "decode can receive at most what prefill holds"),
        ([[5]] + [[]] * 6, [[0]] + [[]] * 6, "group 0: null block paired with a real one (5 -> 0)"),
        ([[5]] + [[]] * 6, [[-1]] + [[]] * 6, "block id -1 is negative"),
    ]
    for remote, local, expected in bad:
        with pytest.raises(ValueError) as err:
            decode.start("r", addr, remote, local)
        assert expected in str(err.value)
        assert_decode_unchanged(decode, before)
    others = decode.pool.allocate(100)  # held by other requests
    before = decode_state(decode)
    with pytest.raises(ValueError, match="request needs 200 local blocks, 155 are free"):
        decode.start("r", addr, [list(range(1, 201))] + [[]] * 6, None)
    assert_decode_unchanged(decode, before)
    decode.pool.free(others)


def test_parse_address() -> None:
    for text in ("localhost", "127.0.0.1:", "127.0.0.1:port", "127.0.0.1:70000", ""):
        with pytest.raises(ValueError, match=r"expected HOST:PORT with a port 0-65535"):
            parse_address(text)
    assert parse_address(":5601") == ("127.0.0.1", 5601)




@pytest.mark.timeout(60)
def test_decode_with_a_smaller_pool_reads_ids_beyond_its_own() -> None:
    """vLLM sizes each instance's pool from its memory: a decode with fewer blocks than
    its prefill (``any_pool_size``, block-major) checks the remote ids against the
    prefill's pool, its local ids against its own; ids beyond either are refused."""
    small = dataclasses.replace(GEMMA, num_blocks=64)
    prefill = make_prefill(GEMMA, lease_s=30.0, transport="loopback")
    with PrefillThread(prefill):
        decode = make_decode(small, transport="loopback", read_timeout_s=5.0,
                             handshake_timeout_s=2.0, any_pool_size=True)
        try:
            addr = prefill.address
            # hold earlier requests so the next one's ids lie beyond the decode's 64
            prefill_request(addr, "filler", 512, seed=4)
            done = prefill_request(addr, "far", 128, seed=5)
            assert max(b for g in done.block_ids for b in g) >= small.num_blocks
            res = decode.start("far", addr, done.block_ids, capability=done.capability)
            res = decode.wait("far", 10.0) if res.status == "pending" else res
            assert res.status == "done", res.reason
            assert max(b for g in res.local_block_ids for b in g) < small.num_blocks
            assert verify_request(decode.cache, res.local_block_ids, 5) == []
            decode.finish("far")
            beyond = [[NUM_BLOCKS + 1] + g[1:] for g in done.block_ids]
            bad = decode.start("bad", addr, beyond, capability=done.capability)
            assert bad.status == "failed" and f"ids must be in [0, {NUM_BLOCKS})" in bad.reason
            assert_clean(decode)
        finally:
            decode.close()
