"""Security of the side channel (issue 13), over the loopback transport.

Peer authentication (a shared key: HMAC-SHA256 over every message both ways, timestamp
and nonce against replay, GetMeta gated like any other message), per-request
capabilities (Acquire, Release and the completion notification must carry the token
prefill issued; a wrong or missing one changes nothing and is counted), the bounded
lease renewal, and bounded input (deep nesting, huge fields, unknown notifications).
Every refusal is checked by its code and counters, never by message text.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator

import msgspec
import pytest

import kvstage as ks
from kvstage.errors import InvalidRequest, NotHeld, PeerError, Unauthorized
from kvstage.pd import auth
from kvstage.pd import messages as m
from kvstage.pd import prefill as prefill_module
from kvstage.pd import prefill_serve as prefill_serve_module
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.prefill_state import MAX_UNKNOWN_NOTIFS
from kvstage.pd.side_channel import SideChannelClient, send_raw
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillThread, make_decode, make_prefill
from tests.helpers import wait_for

LAYOUT = ks.preset("gpt-oss-20b", num_blocks=256, block_size=8)  # 2 groups (SW + full)
NB = LAYOUT.num_blocks
KEY = b"k" * 32
OTHER_KEY = b"x" * 32


@contextlib.contextmanager
def serving(key: bytes | None = None, **options: object) -> Iterator[PrefillThread]:
    server = PrefillThread(make_prefill(LAYOUT, transport="loopback", key=key,
                                         **options))  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def decoding(key: bytes | None = None) -> Iterator[DecodeWorker]:
    with make_decode(LAYOUT, transport="loopback", read_timeout_s=2.0,
                     handshake_timeout_s=3.0, key=key) as worker:
        yield worker


def call(addr: tuple[str, int], msg: m.Message, key: bytes | None = None) -> m.Message:
    return SideChannelClient(*addr, timeout_s=5.0, key=key).call(msg)


def stats(addr: tuple[str, int], key: bytes | None = None) -> m.Stats:
    reply = call(addr, m.GetStats(), key)
    assert isinstance(reply, m.Stats)
    return reply


def prefill(addr: tuple[str, int], rid: str, key: bytes | None = None,
            tokens: int = 100, seed: int = 1) -> m.PrefillDone:
    done = call(addr, m.PrefillRequest(request_id=rid, num_tokens=tokens, seed=seed), key)
    assert isinstance(done, m.PrefillDone)
    return done


def read_ok(decode: DecodeWorker, addr: tuple[str, int], done: m.PrefillDone,
            seed: int = 1) -> None:
    """The honest path: READ with the capability, byte-exact, then give the ids back."""
    res = decode.start(done.request_id, addr, done.block_ids, capability=done.capability)
    if res.status == "pending":
        res = decode.wait(done.request_id, 5.0)
    assert res.status == "done", res.reason
    assert verify_request(decode.cache, res.local_block_ids, seed) == []
    decode.finish(done.request_id)


def refusal_code(exc: BaseException) -> str:
    return exc.remote_code if isinstance(exc, PeerError) else getattr(exc, "code", "")


def raw_call(addr: tuple[str, int], payload: bytes, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes on a REQ socket and return the raw reply (bounded)."""
    reply = send_raw(*addr, payload, timeout_s=timeout_s)
    assert reply is not None, "no reply"
    return reply


def raw_error(addr: tuple[str, int], payload: bytes) -> m.Error:
    reply = auth.Authenticator(None).open_reply(raw_call(addr, payload), None)
    assert isinstance(reply, m.Error), reply
    return reply


# -- capabilities ---------------------------------------------------------------------------
def test_prefill_issues_an_unguessable_capability_per_request() -> None:
    with serving() as server:
        a = prefill(server.address, "a")
        b = prefill(server.address, "b")
        assert len(a.capability) == auth.TOKEN_BYTES == 16
        assert a.capability != b.capability


@pytest.mark.parametrize("token", [b"", b"\x00" * 16, b"short"])
def test_release_without_the_capability_changes_nothing(token: bytes) -> None:
    with serving() as server, decoding() as decode:
        addr = server.address
        done = prefill(addr, "victim")
        with pytest.raises(PeerError) as err:
            call(addr, m.Release(request_id="victim", capability=token))
        assert err.value.remote_code == Unauthorized.code
        s = stats(addr)
        assert (s.held_requests, s.released, s.bad_capability) == (1, 0, 1)
        read_ok(decode, addr, done)  # the legitimate decode is unaffected


def test_acquire_without_the_capability_is_refused_and_counted() -> None:
    with serving() as server, decoding() as decode:
        addr = server.address
        done = prefill(addr, "r")
        res = decode.start("r", addr, done.block_ids)  # no capability given
        assert (res.status, res.code) == ("failed", Unauthorized.code)
        with pytest.raises(PeerError) as err:
            call(addr, m.Acquire(request_id="r", capability=bytes(16)))
        assert err.value.remote_code == Unauthorized.code
        s = stats(addr)
        assert (s.held_requests, s.bad_capability) == (1, 2)
        assert decode.pool is not None and decode.pool.num_free == NB - 1
        read_ok(decode, addr, done)
        wait_for(lambda: stats(addr).completed == 1)  # the notification is asynchronous


def test_release_with_the_capability_frees() -> None:
    with serving() as server:
        done = prefill(server.address, "r")
        assert isinstance(call(server.address, m.Release(request_id="r",
                                                         capability=done.capability)), m.Ok)
        s = stats(server.address)
        assert (s.held_requests, s.released, s.free_blocks) == (0, 1, NB - 1)


def test_forged_completion_notification_frees_nothing() -> None:
    with serving() as server, decoding() as hostile, decoding() as decode:
        addr = server.address
        done = prefill(addr, "victim")
        peer = hostile.connect(*addr).peer
        # the old form (the bare request id) and a wrong token: neither frees
        hostile.transport.send_notif(peer, b"victim")
        hostile.transport.send_notif(peer, auth.completion_notif("victim", bytes(16)))
        deadline = time.monotonic() + 5.0
        while stats(addr).bad_capability + stats(addr).num_unknown_notifs < 2:
            assert time.monotonic() < deadline, "notifications never processed"
            time.sleep(0.01)
        s = stats(addr)
        assert (s.held_requests, s.completed) == (1, 0)
        assert s.bad_capability + s.num_unknown_notifs == 2
        read_ok(decode, addr, done)  # decode's own notification carries the token
        wait_for(lambda: stats(addr).completed == 1)  # the notification is asynchronous
        s = stats(addr)
        assert (s.held_requests, s.completed, s.free_blocks) == (0, 1, NB - 1)


def test_completion_notif_round_trips_any_request_id() -> None:
    token = bytes(range(16))
    for rid in ["r", "a#b", "x" * 300, "é#" + "0" * 32]:
        assert auth.parse_notif(auth.completion_notif(rid, token)) == (rid, token)
    assert auth.parse_notif(b"bare-id") == ("bare-id", b"")
    assert auth.parse_notif(b"\xff" * 40)[1] == b""


# -- peer authentication --------------------------------------------------------------------
def test_derived_capability_is_stateless_and_its_wire_value_fixed() -> None:
    """The derived mode (vLLM connector): the same token from the key, scope and request id
    in any process; a pinned value, so both sides of a mixed-version pair agree."""
    key = b"k" * 32
    cap = auth.derived_capability(key, "engine-a", "r1")
    assert cap.hex() == "f63458ac938381233e6a2463c74de0ac"
    assert auth.derived_capability(key, "engine-a", "r1") == cap
    assert auth.parse_notif(auth.completion_notif("r1", cap)) == ("r1", cap)
    assert auth.same_capability(cap, auth.derived_capability(key, "engine-a", "r1"))
    assert not auth.same_capability(cap, auth.derived_capability(key, "engine-a", "r2"))


def test_keyed_prefill_refuses_every_message_without_the_key() -> None:
    with serving(KEY) as server:
        addr = server.address
        for key in (None, OTHER_KEY):
            for msg in (m.GetMeta(engine_id="x"), m.GetStats(),
                        m.PrefillRequest(request_id="p", num_tokens=8, seed=1)):
                # keyless: the prefill's Error(unauthorized); another key: that reply's MAC
                # does not verify here either
                with pytest.raises((PeerError, Unauthorized)) as err:
                    call(addr, msg, key)
                assert refusal_code(err.value) == Unauthorized.code
        s = stats(addr, KEY)
        assert (s.unauthorized, s.prefilled, s.held_requests) == (6, 0, 0)
        assert isinstance(call(addr, m.GetMeta(engine_id="x"), KEY), m.Meta)


def test_keyed_pair_reads_byte_exact_and_a_keyless_decode_cannot_handshake() -> None:
    with serving(KEY) as server, decoding(KEY) as decode, decoding() as keyless:
        addr = server.address
        done = prefill(addr, "r", KEY)
        with pytest.raises(PeerError) as err:
            keyless.connect(*addr)  # no key, no NIXL metadata
        assert err.value.remote_code == Unauthorized.code
        read_ok(decode, addr, done)
        wait_for(lambda: stats(addr, KEY).completed == 1)  # the notification is asynchronous
        s = stats(addr, KEY)
        assert (s.completed, s.held_requests, s.free_blocks, s.unauthorized) == (1, 0, NB - 1, 1)


def test_replayed_message_is_refused() -> None:
    with serving(KEY) as server:
        addr = server.address
        done = prefill(addr, "r", KEY)
        wire, _nonce = auth.Authenticator(KEY).seal(
            m.Release(request_id="r", capability=done.capability))
        first = auth.Authenticator(KEY).open_reply(raw_call(addr, wire), None)
        assert isinstance(first, m.Ok)
        prefill(addr, "r", KEY)  # re-prefilled under the same id: a replay must not free it
        again = auth.Authenticator(KEY).open_reply(raw_call(addr, wire), None)
        assert isinstance(again, m.Error) and again.code == Unauthorized.code
        s = stats(addr, KEY)
        assert (s.held_requests, s.released, s.unauthorized) == (1, 1, 1)


@pytest.mark.parametrize("skew_s", [-31.0, 31.0, -3600.0])
def test_stale_or_future_timestamp_is_refused(skew_s: float) -> None:
    with serving(KEY) as server:
        sealer = auth.Authenticator(KEY, clock=lambda: time.time() + skew_s)
        wire, _ = sealer.seal(m.GetStats())
        reply = auth.Authenticator(None).open_reply(raw_call(server.address, wire), None)
        assert isinstance(reply, m.Error) and reply.code == Unauthorized.code
        assert stats(server.address, KEY).unauthorized == 1


def test_tampered_payload_is_refused() -> None:
    with serving(KEY) as server:
        wire, _ = auth.Authenticator(KEY).seal(m.GetStats())
        env = msgspec.msgpack.decode(wire)
        env["payload"] = m.encode(m.PrefillRequest(request_id="t", num_tokens=8, seed=1))
        assert raw_error(server.address, msgspec.msgpack.encode(env)).code == Unauthorized.code
        s = stats(server.address, KEY)
        assert (s.unauthorized, s.prefilled) == (1, 0)


def test_keyed_client_refuses_an_unauthenticated_reply() -> None:
    with serving() as server, pytest.raises(Unauthorized):
        call(server.address, m.GetStats(), KEY)


def test_reply_must_answer_this_request() -> None:
    a = auth.Authenticator(KEY)
    wire, nonce = a.seal(m.Ok(), reply_to=b"\x01" * 16)
    with pytest.raises(Unauthorized):
        a.open_reply(wire, b"\x02" * 16)
    assert isinstance(a.open_reply(wire, b"\x01" * 16), m.Ok)
    assert len(nonce) == 16


def test_nonce_cache_is_bounded_and_time_windowed() -> None:
    now = [1000.0]
    a = auth.Authenticator(KEY, clock=lambda: now[0], max_nonces=4)
    sealer = auth.Authenticator(KEY, clock=lambda: now[0])
    wires = [sealer.seal(m.GetStats())[0] for _ in range(5)]
    for w in wires[:4]:
        a.open_request(w)
    with pytest.raises(Unauthorized):  # full: refuse rather than forget a live nonce
        a.open_request(wires[4])
    assert a.num_nonces == 4
    now[0] += 2 * auth.MAX_SKEW_S + 1  # every remembered nonce is now stale anyway
    fresh = sealer.seal(m.GetStats())[0]
    a.open_request(fresh)
    assert a.num_nonces == 1


def test_nonloopback_bind_needs_a_key_or_insecure() -> None:
    for host in ("0.0.0.0", "10.1.2.3", "example.com"):
        with pytest.raises(InvalidRequest):
            auth.check_bind(host, None, insecure=False)
        auth.check_bind(host, KEY, insecure=False)
        auth.check_bind(host, None, insecure=True)
    for host in ("127.0.0.1", "127.0.0.2", "localhost"):
        auth.check_bind(host, None, insecure=False)
    with pytest.raises(InvalidRequest):
        make_prefill(LAYOUT, transport="loopback", host="0.0.0.0")


def test_short_key_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        auth.Authenticator(b"short")


# -- lease renewal bounded ------------------------------------------------------------------
def test_lease_renewal_is_bounded_by_max_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    fake = types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(prefill_module, "time", fake)
    monkeypatch.setattr(prefill_serve_module, "time", fake)  # the Acquire's clock
    with make_prefill(LAYOUT, transport="loopback", lease_s=10.0, max_hold_s=25.0) as worker:
        done = worker.prefill("r", 64, 1)
        acquire = m.Acquire(request_id="r", capability=done.capability)
        for _ in range(2):  # renewals inside the bound
            clock[0] += 9.0
            lease = worker._handle(acquire)
            assert isinstance(lease, m.Lease)
        clock[0] += 5.0  # 23 s held: the lease ends at 25 s, not 33 s
        lease = worker._handle(acquire)
        assert isinstance(lease, m.Lease) and lease.remaining_s == pytest.approx(2.0)
        clock[0] += 2.0
        with pytest.raises(NotHeld):
            worker._handle(acquire)
        assert (worker.num_held, worker.counters.expired) == (0, 1)
        assert worker.pool is not None and worker.pool.num_free == NB - 1


def test_max_hold_must_be_finite_positive() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRequest):
            make_prefill(LAYOUT, transport="loopback", max_hold_s=bad)


# -- bounded input --------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1000, 100_000, 900_000])
@pytest.mark.parametrize("key", [None, KEY])
def test_deeply_nested_msgpack_is_refused_and_prefill_survives(depth: int,
                                                              key: bytes | None) -> None:
    nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    as_map = b"\x81\xa1a" * (depth // 3) + b"\xc0"  # {"a": {"a": ...}}
    with serving(key) as server, decoding(key) as decode:
        addr = server.address
        for payload in (nested, as_map):
            assert raw_error(addr, payload).code in ("protocol_mismatch", Unauthorized.code)
        if key is None:  # a well-formed envelope whose payload nests deeply
            env = {"version": m.PROTOCOL_VERSION, "ts_ms": int(time.time() * 1000),
                   "nonce": bytes(16), "reply_to": b"", "mac": b"", "payload": nested}
            err = raw_error(addr, msgspec.msgpack.encode(env))
            assert err.code == "protocol_mismatch"
        read_ok(decode, addr, prefill(addr, "after", key))


def test_errors_never_echo_much_input() -> None:
    with serving() as server:
        big = "A" * 200_000
        reply = raw_call(server.address, auth.Authenticator(None).seal(
            m.Acquire(request_id=big, capability=b""))[0])
        assert len(reply) < 4096
        err = auth.Authenticator(None).open_reply(reply, None)
        assert isinstance(err, m.Error) and len(err.message) <= 512
        junk = raw_call(server.address, b"\xa5" + b"B" * 100_000)
        assert len(junk) < 4096


def test_oversized_message_is_dropped_and_prefill_survives() -> None:
    with serving() as server:
        oversized = b"\x00" * (m.MAX_MESSAGE_BYTES + 1)
        # zmq dropped the connection: no reply
        assert send_raw(*server.address, oversized, timeout_s=0.3) is None
        assert stats(server.address).held_requests == 0


def test_unknown_notifications_are_bounded() -> None:
    with serving() as server, decoding() as hostile:
        addr = server.address
        peer = hostile.connect(*addr).peer
        n = MAX_UNKNOWN_NOTIFS * 3
        for i in range(n):
            hostile.transport.send_notif(peer, f"ghost-{i}-".encode() + b"Z" * 500)
        deadline = time.monotonic() + 5.0
        while stats(addr).num_unknown_notifs < n:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s = stats(addr)
        assert s.num_unknown_notifs == n
        assert len(s.unknown_notifs) == MAX_UNKNOWN_NOTIFS
        assert all(len(r) <= 64 for r in s.unknown_notifs)
        assert s.unknown_notifs[-1].startswith(f"ghost-{n - 1}-")


@pytest.mark.parametrize(
    "fields",
    [{"ts_ms": (1 << 64) - 1}, {"ts_ms": 1 << 63}, {"nonce": b"n" * 300},
     {"reply_to": b"r" * 300}],
    ids=["uint64-ts", "int64-overflow-ts", "long-nonce", "long-reply-to"],
)
def test_envelope_fields_out_of_range_are_refused_and_the_server_lives(
    fields: dict[str, object]
) -> None:
    """Found by the live fuzz: a MAC'd envelope whose timestamp does not fit int64 crashed
    the keyed prefill (struct.error while packing the MAC header)."""
    with serving(KEY) as server:
        env = {"version": m.PROTOCOL_VERSION, "ts_ms": int(time.time() * 1000),
               "nonce": b"n" * auth.NONCE_BYTES, "reply_to": b"", "mac": b"m" * 32,
               "payload": m.encode(m.GetStats())} | fields
        reply = raw_error(server.address, msgspec.msgpack.encode(env))
        assert reply.code == "protocol_mismatch"
        assert stats(server.address, KEY).held_requests == 0  # still serving
