"""Bad input: every kind is refused with an error that says what was expected, and
leaves every byte and counter as it was (caches, host buffers, pools, P/D state).

Each test clones the state it could touch before the bad call and compares after.
Kinds are counted in RELIABILITY.md (one test function per kind, parametrised
variants of one kind count once).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

import kvstage as ks
from kvstage.cli import main as cli_main
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.side_channel import PeerError, SideChannelClient, parse_address
from kvstage.testing.servers import PrefillThread, make_decode, make_prefill
from kvstage.transport import LoopbackTransport

pytestmark = pytest.mark.timeout(60)



# ------------------------------------------------------------------------ snapshots
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


@dataclass
class EngineState:
    cache: torch.Tensor
    host: torch.Tensor


def snap(engine: ks.CopyEngine) -> EngineState:
    return EngineState(_bytes(engine.cache.slab), _bytes(engine.host.storage))


def assert_unchanged(engine: ks.CopyEngine, before: EngineState) -> None:
    assert torch.equal(_bytes(engine.cache.slab), before.cache), "device cache changed"
    assert torch.equal(_bytes(engine.host.storage), before.host), "host buffer changed"


def pool_state(pool: ks.BlockPool) -> tuple[list[int], list[int]]:
    return list(pool._free), sorted(pool._used)


@pytest.fixture
def engine() -> ks.CopyEngine:
    layout = ks.preset("gemma-3-1b", num_blocks=64, block_size=4)  # 7 groups, 4 tensors
    cache = ks.KVCache(layout)
    cache.fill_random(1)
    host = ks.HostBuffer(layout)
    eng = ks.CopyEngine(cache, host)
    eng.save_to_host([[1, 2], [3], [], [4], [5], [6], [7, 8, 9]])  # host is not all zeros
    cache.fill_random(2)
    return eng


def ok_ids() -> list[list[int]]:
    return [[10, 11], [12], [], [13], [14], [0, 15], [16, 17]]


# ------------------------------------------------------------------------ block ids
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


# ------------------------------------------------------------------------ engine set-up
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
    cache_before, host_before = _bytes(cache.slab), _bytes(host.storage)
    with pytest.raises(ValueError) as err:
        ks.CopyEngine(cache, host)
    msg = str(err.value)
    assert "device cache and host buffer were built for different layouts" in msg
    assert expected in msg
    assert "build both from one KVLayout" in msg
    assert torch.equal(_bytes(cache.slab), cache_before)
    assert torch.equal(_bytes(host.storage), host_before)


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


# ------------------------------------------------------------------------ layouts
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


def test_unknown_preset() -> None:
    with pytest.raises(ValueError) as err:
        ks.preset("gemma-4-huge")
    msg = str(err.value)
    assert "unknown preset 'gemma-4-huge'; choose one of" in msg
    assert all(name in msg for name in ks.PRESETS)


# ------------------------------------------------------------------------ block pool
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


# ------------------------------------------------------------------------ side channel
def test_message_from_another_version() -> None:
    data = msgspec.msgpack.encode({"type": "get_meta", "version": 99, "engine_id": "x"})
    with pytest.raises(ValueError) as err:
        m.decode(data)
    msg = str(err.value)
    assert f"protocol version 99, this kvstage speaks {m.PROTOCOL_VERSION}" in msg
    assert "run the same kvstage version on prefill and decode" in msg
    no_version = msgspec.msgpack.encode({"type": "get_meta", "engine_id": "x"})
    with pytest.raises(ValueError, match="protocol version None"):
        m.decode(no_version)


GOOD = m.encode(m.PrefillRequest(request_id="r", num_tokens=10, seed=1))
GARBLED = {
    "truncated": GOOD[: len(GOOD) // 2],
    "empty": b"",
    "random": bytes(range(200, 256)) * 2,
    "not-a-map": msgspec.msgpack.encode([1, 2, 3]),
    "unknown-type": msgspec.msgpack.encode({"type": "launch", "version": m.PROTOCOL_VERSION}),
    "wrong-field-type": msgspec.msgpack.encode(
        {"type": "prefill", "version": m.PROTOCOL_VERSION, "request_id": "r",
         "num_tokens": "ten", "seed": 1}
    ),
    "missing-field": msgspec.msgpack.encode(
        {"type": "prefill", "version": m.PROTOCOL_VERSION, "seed": 1}),
}


@pytest.mark.parametrize("name", sorted(GARBLED))
def test_truncated_or_garbled_message(name: str) -> None:
    with pytest.raises(ValueError) as err:
        m.decode(GARBLED[name])
    msg = str(err.value)
    assert ("is not a kvstage message" in msg) or ("malformed side-channel message" in msg)
    assert m.decode(GOOD) == m.PrefillRequest(request_id="r", num_tokens=10, seed=1)


# ------------------------------------------------------------------------ P/D fixtures
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


def raw_call(addr: tuple[str, int], payload: bytes) -> m.AnyMessage:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{addr[0]}:{addr[1]}")
        sock.send(payload)
        assert sock.poll(5000), "prefill did not answer a garbled message"
        return m.decode(sock.recv())
    finally:
        sock.close(linger=0)


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
                       d.transport.num_open_handles, len(d._remotes), _bytes(d.host.storage),
                       _bytes(d.cache.slab))


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


# ------------------------------------------------------------------------ P/D bad input
def test_garbled_message_to_live_prefill(prefill: PrefillThread) -> None:
    addr = prefill.address
    before = stats(addr)
    pool_before = pool_state(prefill.worker.pool)
    host_before = _bytes(prefill.worker.host.storage)
    for name, payload in sorted(GARBLED.items()):
        reply = raw_call(addr, payload)
        assert isinstance(reply, m.Error), name
        assert ("is not a kvstage message" in reply.message
                or "malformed side-channel message" in reply.message), reply.message
    reply = raw_call(addr, msgspec.msgpack.encode({"type": "get_stats", "version": 99}))
    assert isinstance(reply, m.Error) and "protocol version 99" in reply.message
    assert stats(addr) == before  # still serving, nothing changed
    assert pool_state(prefill.worker.pool) == pool_before
    assert torch.equal(_bytes(prefill.worker.host.storage), host_before)
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
    host_before = _bytes(prefill.worker.host.storage)
    with pytest.raises(PeerError, match="request id 'dup' is still held \\(in flight\\); use a "
                       "new id or wait until decode has read it"):
        client.call(m.PrefillRequest(request_id="dup", num_tokens=16, seed=2))
    assert stats(prefill.address) == before
    assert torch.equal(_bytes(prefill.worker.host.storage), host_before)


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
    first = decode.start("dup", addr, done.block_ids)
    assert first.status == "pending"
    before = decode_state(decode)
    prefill_before = stats(addr)
    with pytest.raises(ValueError, match="request id 'dup' is already in flight here; finish "
                       "or abort it first, or use a new id"):
        decode.start("dup", addr, done.block_ids)
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


# ------------------------------------------------------------------------ CLI flags
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["decode", "--requests", "0"],
         "argument --requests: --requests must be > 0 and <= 1e+06, got 0"),
        (["decode", "--prompt-tokens", "-1"], "--prompt-tokens must be > 0"),
        (["decode", "--read-timeout-s", "abc"], "--read-timeout-s must be a number, got 'abc'"),
        (["prefill", "--lease-s", "0"], "--lease-s must be > 0 and <= 86400, got 0"),
        (["bench", "copy", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["bench", "soak", "--requests", "0"], "--requests must be > 0 and <= 1e+07, got 0"),
        (["bench", "soak", "--fault-rate", "1.5"], "--fault-rate must be >= 0 and <= 1, got 1.5"),
        (["bench", "soak", "--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
        # careless input: NaN and infinities never pass for a positive number
        (["prefill", "--lease-s", "nan"], "--lease-s must be a finite number, got 'nan'"),
        (["decode", "--read-timeout-s", "nan"], "--read-timeout-s must be a finite number"),
        (["decode", "--handshake-timeout-s", "inf"], "--handshake-timeout-s must be a finite"),
        (["bench", "soak", "--lease-s=-inf"], "--lease-s must be a finite number"),
        (["decode", "--num-blocks", "1"], "--num-blocks must be >= 2, got 1"),
        (["decode", "--prompt-tokens", "100000000"], "--prompt-tokens must be > 0 and <= "),
        (["decode", "--json", "/nonexistent/x.json"], "folder '/nonexistent' of"),
    ],
    ids=["decode-requests", "decode-tokens", "decode-timeout", "prefill-lease", "copy-iters",
         "soak-requests", "soak-fault-rate", "soak-transport", "lease-nan", "read-nan",
         "handshake-inf", "soak-lease-inf", "num-blocks-1", "prompt-1e8", "json-unwritable"],
)
def test_cli_flag_out_of_range(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


# ------------------------------------------------------------------------ vLLM drop-in


def dropin_caches(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """gemma-3-1b-like dicts: 26 layer names over 4 physical tensors on each side."""
    layout = ks.preset("gemma-3-1b", num_blocks=16, block_size=4)
    cache, host = ks.KVCache(layout), ks.HostBuffer(layout, ks.HostLayout.MIRROR)
    cache.fill_random(seed)
    return cache.layer_caches(), host.layer_views()


def dict_bytes(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [_bytes(t) for t in caches.values()]


def assert_dicts_unchanged(caches: dict[str, torch.Tensor], before: list[torch.Tensor]) -> None:
    assert all(torch.equal(_bytes(t), b) for t, b in zip(caches.values(), before, strict=True))


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda s, d, i: (s, d, [1, 2, 3], [4, 5]),
         "src_block_ids has 3 ids, dst_block_ids has 2; they pair one to one"),
        (lambda s, d, i: ({}, d, i, i), "src_caches is empty: pass one tensor per layer name"),
        (lambda s, d, i: (s, {}, i, i), "dst_caches is empty: pass one tensor per layer name"),
        (lambda s, d, i: (s, d, [1, 16], [2, 3]),
         "src_block_ids has id 16 out of range: the src tensors hold 16 blocks along dim 0, "
         "ids must be in [0, 16)"),
        (lambda s, d, i: (s, d, [1, -2], [2, 3]), "src_block_ids[1] is -2: block ids are >= 0"),
        (lambda s, d, i: (s, dict(list(d.items())[:-1]), i, i),
         "src_caches and dst_caches must have the same layer names"),
        (lambda s, d, i: (s, {k: v.to(torch.float16) for k, v in d.items()}, i, i),
         "both sides need one shape and dtype"),
    ],
    ids=["length-mismatch", "empty-src", "empty-dst", "out-of-range", "negative",
         "layer-names", "dtype"],
)
def test_dropin_copy_blocks_refuses(mutate: Any, expected: str) -> None:
    from kvstage.integrations.vllm import copy_blocks

    src, dst = dropin_caches()
    src_before, dst_before = dict_bytes(src), dict_bytes(dst)
    s, d, si, di = mutate(src, dst, [1, 2])
    with pytest.raises(ValueError) as err:
        copy_blocks(s, d, si, di, "d2h")
    assert expected in str(err.value)
    assert_dicts_unchanged(src, src_before)
    assert_dicts_unchanged(dst, dst_before)


def test_dropin_wrong_device_and_types() -> None:
    from kvstage.integrations.vllm import copy_blocks

    src, dst = dropin_caches()
    src_before, dst_before = dict_bytes(src), dict_bytes(dst)
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in dst.items()}
    with pytest.raises(ValueError, match="d2h copies to the host: dst_caches must be on the "
                       "CPU, got meta"):
        copy_blocks(src, meta, [1], [2], "d2h")
    with pytest.raises(ValueError, match="h2d copies from the host: src_caches must be on the "
                       "CPU, got meta"):
        copy_blocks(meta, dst, [1], [2], "h2d")
    mixed = dict(src)
    mixed["layers.0"] = torch.empty(src["layers.0"].shape, dtype=src["layers.0"].dtype,
                                    device="meta")
    with pytest.raises(ValueError, match="src_caches span devices"):
        copy_blocks(mixed, dst, [1], [2], "d2h")
    with pytest.raises(ValueError, match="direction must be 'h2d' or 'd2h', got 'sideways'"):
        copy_blocks(src, dst, [1], [2], "sideways")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"src_block_ids\[0\] must be an int block id, got "
                       "float 1.0"):
        copy_blocks(src, dst, [1.0], [2], "d2h")  # type: ignore[list-item]
    with pytest.raises(TypeError, match="dst_caches\\['layers.0'\\] must be a torch.Tensor"):
        copy_blocks(src, {k: v.tolist() for k, v in dst.items()}, [1], [2], "d2h")  # type: ignore[misc]
    assert_dicts_unchanged(src, src_before)
    assert_dicts_unchanged(dst, dst_before)


def test_dropin_non_contiguous_views_copy_exactly() -> None:
    """A strided (transposed) view is a valid cache: accepted, and every byte lands."""
    from kvstage.integrations.vllm import copy_blocks

    src = {"a": torch.randn(2, 8, 4, 1, 4).transpose(0, 1)}  # [8, 2, 4, 1, 4], strided
    assert not src["a"].is_contiguous()
    dst = {"a": torch.zeros(8, 2, 4, 1, 4)}
    before = dst["a"].clone()
    copy_blocks(src, dst, [1, 2, 6], [3, 4, 0], "d2h")
    want = before.clone()
    want[[3, 4, 0]] = src["a"][[1, 2, 6]]
    assert torch.equal(dst["a"], want)


def test_dropin_refuses_overlapping_destination() -> None:
    """Stride 0 along the blocks: dst blocks 3 and 5 would share bytes and one would
    silently overwrite the other."""
    from kvstage.integrations.vllm import copy_blocks

    src = {"a": torch.randn(8, 2, 4, 1, 4)}
    dst = {"a": torch.zeros(1, 2, 4, 1, 4).expand(8, 2, 4, 1, 4)}
    before = _bytes(dst["a"])
    with pytest.raises(ValueError, match=r"dst_caches\['a'\] has elements that overlap in "
                       r"memory \(stride \(0, 16, 4, 4, 1\)"):
        copy_blocks(src, dst, [1, 2], [3, 5], "d2h")
    assert torch.equal(_bytes(dst["a"]), before)
