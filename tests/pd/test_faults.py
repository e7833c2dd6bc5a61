"""Faults on the P/D path with the loopback transport's fault options (fail_reads,
drop_notifs, stall_reads) and misbehaving side channels.

After every fault: nothing hangs (each test has a timeout and every wait is bounded),
the request ends "failed" or "aborted" with a reason, no block leaks (decode pool back
to num_blocks - 1 free after finish/abort; prefill free again after its lease), no
transfer handle stays open, and the next request works byte-exact.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

import kvstage as ks
from kvstage.errors import HandshakeTimeout
from kvstage.pd import messages as m
from kvstage.pd.decode import READ_FAILED, DecodeWorker
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillThread, make_decode, make_prefill
from tests import helpers
from tests.helpers import finish_read, prefill_request, stats_of

LAYOUT = ks.preset("gpt-oss-20b", num_blocks=512, block_size=8)  # 2 groups (SW + full)
NB = LAYOUT.num_blocks
LEASE_S = 1.0
READ_TIMEOUT_S = 0.3


@contextlib.contextmanager
def serving(*, lease_s: float = LEASE_S, port: int = 0) -> Iterator[PrefillThread]:
    server = PrefillThread(make_prefill(LAYOUT, transport="loopback", lease_s=lease_s,
                                         port=port))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prefill() -> Iterator[PrefillThread]:
    with serving() as server:
        yield server


@pytest.fixture
def decode() -> Iterator[DecodeWorker]:
    with make_decode(LAYOUT, transport="loopback", read_timeout_s=READ_TIMEOUT_S,
                      handshake_timeout_s=2.0) as worker:
        yield worker


def set_faults(decode: DecodeWorker, **flags: bool) -> None:
    t: Any = decode.transport
    t.fail_reads = flags.get("fail_reads", False)
    t.drop_notifs = flags.get("drop_notifs", False)
    t.stall_reads = flags.get("stall_reads", False)


def assert_decode_clean(decode: DecodeWorker) -> None:
    assert decode.pool.num_free == NB - 1, "decode leaked blocks"
    assert decode.transport.num_open_handles == 0, "decode leaked transfer handles"
    assert decode.num_draining == 0 and decode.num_pending == 0


def wait_prefill_free(addr: tuple[str, int], timeout_s: float = LEASE_S + 5) -> m.Stats:
    return helpers.wait_prefill_free(addr, NB, timeout_s)


def assert_next_request_works(decode: DecodeWorker, addr: tuple[str, int], rid: str) -> None:
    set_faults(decode)
    done = prefill_request(addr, rid, tokens=333, seed=77)
    res = finish_read(decode, decode.start(rid, addr, done.block_ids,
                                          capability=done.capability))
    assert res.ok, res.reason
    assert verify_request(decode.cache, res.local_block_ids, 77) == []
    decode.finish(rid)
    assert_decode_clean(decode)


# ------------------------------------------------------------------------ READ faults
@pytest.mark.timeout(30)
def test_read_failure(prefill: PrefillThread, decode: DecodeWorker) -> None:
    addr = prefill.address
    done = prefill_request(addr, "r1")
    set_faults(decode, fail_reads=True)
    res = finish_read(decode, decode.start("r1", addr, done.block_ids,
                                          capability=done.capability))
    assert res.status == "failed"
    assert res.code == READ_FAILED and "fail_reads=True" in res.reason  # the transport's words
    assert_decode_clean(decode)  # local blocks freed, handle released, h2d skipped
    s = wait_prefill_free(addr)  # no notification: the lease frees prefill's blocks
    assert (s.completed, s.expired) == (0, 1)
    assert_next_request_works(decode, addr, "r2")


@pytest.mark.timeout(30)
def test_notification_lost(prefill: PrefillThread, decode: DecodeWorker) -> None:
    addr = prefill.address
    done = prefill_request(addr, "r1", seed=5)
    set_faults(decode, drop_notifs=True)
    res = finish_read(decode, decode.start("r1", addr, done.block_ids,
                                          capability=done.capability))
    assert res.ok and verify_request(decode.cache, res.local_block_ids, 5) == []
    decode.finish("r1")
    assert_decode_clean(decode)
    assert stats_of(addr).held_requests == 1  # prefill never heard the READ ended ...
    s = wait_prefill_free(addr)  # ... so its lease frees the blocks
    assert (s.completed, s.expired, s.unknown_notifs) == (0, 1, [])
    assert_next_request_works(decode, addr, "r2")


@pytest.mark.timeout(30)
def test_read_stalls_until_the_deadline(prefill: PrefillThread, decode: DecodeWorker) -> None:
    addr = prefill.address
    done = prefill_request(addr, "r1")
    set_faults(decode, stall_reads=True)
    res = finish_read(decode, decode.start("r1", addr, done.block_ids,
                                          capability=done.capability))
    assert res.status == "failed" and res.reason.startswith("READ timed out after")
    # the READ may still write (late bytes): its blocks stay quarantined, not in the pool
    num = sum(1 for g in res.local_block_ids for b in g if b)
    assert decode.num_draining == 1 and decode.pool.num_free == NB - 1 - num
    assert all(decode.in_flight(b) for g in res.local_block_ids for b in g if b)
    assert wait_prefill_free(addr).expired == 1
    set_faults(decode)
    assert decode.transport.resume_reads() == 1  # type: ignore[attr-defined]
    decode.poll()  # the READ is over: now the blocks go back
    assert_decode_clean(decode)
    assert_next_request_works(decode, addr, "r2")


@pytest.mark.timeout(60)
def test_many_requests_aborted_mid_flight(decode: DecodeWorker) -> None:
    # a lease far longer than posting 50 requests takes on a loaded host, so every one is
    # still held when it is aborted (the test counts Releases, not expiries)
    with serving(lease_s=60.0) as server:
        _abort_fifty(server.address, decode)


def _abort_fifty(addr: tuple[str, int], decode: DecodeWorker) -> None:
    set_faults(decode, stall_reads=True)
    results = []
    for i in range(50):
        done = prefill_request(addr, f"a{i}", tokens=16 + i % 9, seed=i)
        results.append(decode.start(f"a{i}", addr, done.block_ids,
                                    capability=done.capability))
    assert decode.num_pending == 50
    assert decode.transport.num_open_handles == 50
    ended = [decode.abort(r.request_id, reason=f"client went away ({r.request_id})")
             for r in results]
    assert [r.status for r in ended] == ["aborted"] * 50
    assert all(r.reason == f"client went away ({r.request_id})" for r in ended)
    assert all(r is e for r, e in zip(results, ended, strict=True))  # same objects, updated
    assert decode.num_draining == 50  # quarantined until the READs are over
    set_faults(decode)
    assert decode.transport.resume_reads() == 50  # type: ignore[attr-defined]
    decode.poll()
    assert_decode_clean(decode)
    s = stats_of(addr)  # abort sends Release: prefill frees at once, not at lease end
    assert (s.released, s.expired, s.held_requests) == (50, 0, 0)
    wait_prefill_free(addr)
    with pytest.raises(ValueError, match="'a0' is not pending"):
        decode.abort("a0")
    assert_next_request_works(decode, addr, "next")


@pytest.mark.timeout(30)
def test_abort_after_the_read_completed(prefill: PrefillThread, decode: DecodeWorker) -> None:
    """Abort races the notification: prefill frees once, the loser is reported, no crash."""
    addr = prefill.address
    done = prefill_request(addr, "r1")
    # loopback READ done, notification queued
    decode.start("r1", addr, done.block_ids, capability=done.capability)
    res = decode.abort("r1", reason="caller gave up")
    assert (res.status, res.reason) == ("aborted", "caller gave up")
    assert_decode_clean(decode)
    s = wait_prefill_free(addr)
    assert s.completed + s.released == 1 and s.expired == 0
    assert len(s.unknown_notifs) == s.released  # a late notification, reported, not fatal
    assert_next_request_works(decode, addr, "r2")


@pytest.mark.timeout(30)
def test_wait_backstop_and_close_abort_stalled_reads(prefill: PrefillThread) -> None:
    addr = prefill.address
    worker = make_decode(LAYOUT, transport="loopback", read_timeout_s=0.9,
                          handshake_timeout_s=2.0)
    try:
        set_faults(worker, stall_reads=True)
        for rid in ("w1", "c1", "c2"):
            done = prefill_request(addr, rid)
            worker.start(rid, addr, done.block_ids, capability=done.capability)
        res = worker.wait("w1", timeout_s=0.05)  # gives up before the READ deadline
        assert res.status == "aborted" and "wait() gave up after 0.05 s" in res.reason
        pending = [p.result for p in worker._pending.values()]
    finally:
        worker.close()  # aborts what is pending: nothing leaks
    assert [(r.status, r.reason) for r in pending] == [("aborted", "decode worker closed")] * 2
    assert worker.pool.num_free == NB - 1 and worker.num_draining == 0
    assert wait_prefill_free(addr).released == 3


# ------------------------------------------------------------------------ leases
@pytest.mark.timeout(30)
def test_lease_expired_before_decode_reads(prefill: PrefillThread, decode: DecodeWorker) -> None:
    addr = prefill.address
    done = prefill_request(addr, "late")
    s = wait_prefill_free(addr)  # decode "was slow": the lease ends first
    assert s.expired == 1
    res = decode.start("late", addr, done.block_ids, capability=done.capability)
    assert res.status == "failed"
    assert "request 'late' is not held here" in res.reason and "lease expired" in res.reason
    assert_decode_clean(decode)
    assert_next_request_works(decode, addr, "r2")


@pytest.mark.timeout(30)
def test_decode_never_reads(prefill: PrefillThread, decode: DecodeWorker) -> None:
    """A decode that dies after the prefill (here: just never reads) costs a lease."""
    addr = prefill.address
    for i in range(5):
        prefill_request(addr, f"orphan{i}", tokens=50 + i)
    assert stats_of(addr).held_requests == 5
    s = wait_prefill_free(addr)
    assert s.expired == 5
    assert_next_request_works(decode, addr, "r2")


# ------------------------------------------------------------------------ side channel
def _assert_handshake_times_out(addr: tuple[str, int]) -> None:
    worker = make_decode(LAYOUT, transport="loopback", read_timeout_s=READ_TIMEOUT_S,
                          handshake_timeout_s=0.5)
    try:
        with pytest.raises(HandshakeTimeout) as err:
            worker.connect(*addr)
        assert f"no answer from tcp://127.0.0.1:{addr[1]} within 0.5 s" in str(err.value)
        assert "is a kvstage prefill worker listening there" in str(err.value)
        res = worker.start("r", addr, [[1, 2], [3]])
        assert res.status == "failed" and res.reason.startswith("HandshakeTimeout: no answer")
        assert worker.pool.num_free == NB - 1 and worker.transport.num_open_handles == 0
        assert worker.num_pending == 0 and not worker._remotes
    finally:
        worker.close()


@pytest.mark.timeout(30)
def test_side_channel_bound_but_never_answers() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        _assert_handshake_times_out(("127.0.0.1", port))
    finally:
        router.close(linger=0)


@pytest.mark.timeout(30)
def test_side_channel_port_with_nothing_serving() -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        _assert_handshake_times_out(("127.0.0.1", sock.getsockname()[1]))


@pytest.mark.timeout(30)
def test_side_channel_answers_garbage() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = make_decode(LAYOUT, transport="loopback", handshake_timeout_s=2.0)
    answered = []

    def answer() -> None:  # one reply that is valid msgpack but no kvstage message
        if router.poll(5000):
            frames = router.recv_multipart()
            router.send_multipart([*frames[:-1], b"\x93\x01\x02"])
            answered.append(True)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        res = worker.start("g", ("127.0.0.1", port), [[1], [2]])
        thread.join(10)
        assert answered and res.status == "failed"
        assert "side-channel message is not a kvstage message" in res.reason
        assert worker.pool.num_free == NB - 1 and not worker._remotes
    finally:
        worker.close()
        router.close(linger=0)


@pytest.mark.timeout(60)
def test_prefill_gone_then_restarted_on_the_same_port(decode: DecodeWorker) -> None:
    """A prefill that dies takes its side channel and agent with it; one restarted on the
    same address is a new agent. The cached handshake must not outlive the old one."""
    with serving(lease_s=2.0) as first:
        addr = first.address
        assert_next_request_works(decode, addr, "before")
        done = prefill_request(addr, "orphan")
    # prefill is gone: the side channel does not answer, the request fails, bounded
    res = decode.start("orphan", addr, done.block_ids, capability=done.capability)
    assert res.status == "failed" and res.code == HandshakeTimeout.code
    assert_decode_clean(decode)
    with serving(lease_s=2.0, port=addr[1]) as second:
        assert second.address == addr
        outcomes = []
        for i in range(3):  # the Lease names the new engine: handshaken again, no READ lost
            rid = f"after{i}"
            d = prefill_request(addr, rid, seed=i + 10)
            r = finish_read(decode, decode.start(rid, addr, d.block_ids,
                                              capability=d.capability))
            outcomes.append(r.status)
            if r.ok:
                assert verify_request(decode.cache, r.local_block_ids, i + 10) == []
                decode.finish(rid)
        assert outcomes == ["done", "done", "done"], outcomes
        assert_decode_clean(decode)
        s = wait_prefill_free(addr, timeout_s=10)
        assert s.completed == outcomes.count("done")
