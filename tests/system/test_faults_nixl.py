"""Faults with real NIXL (UCX over 127.0.0.1) between processes: prefill in a spawned
child (`kvstage.testing.servers.PrefillProcess`), decode in this process (or in a child where
the decode is the one that dies). Children are killed or stopped in ``finally``.

After each fault: bounded (test timeouts, bounded waits), the request ends "failed" or
"aborted" with a reason, no decode block or transfer handle leaks, prefill frees its
blocks (notification, Release or lease), and the next request works byte-exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from kvstage.errors import TransportFailure
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.side_channel import HandshakeTimeout
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillProcess, make_decode
from tests.helpers import call, finish_read, prefill_request, stats_of

HAVE_NIXL = any(importlib.util.find_spec(n) is not None for n in ("nixl_cu12", "nixl"))

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not HAVE_NIXL, reason="NIXL not installed (kvstage[nixl])"),
]

SMALL = preset("gemma-3-1b", num_blocks=256, block_size=16)
LEASE_S = 1.5
READ_TIMEOUT_S = 1.0


@contextlib.contextmanager
def prefill_child(choice: KVLayout = SMALL, *, lease_s: float = LEASE_S,
                  port: int = 0) -> Iterator[PrefillProcess]:
    child = PrefillProcess(choice, transport="nixl", lease_s=lease_s, port=port)
    try:
        child.wait_ready()
        yield child
    finally:
        child.stop()


@contextlib.contextmanager
def decoder(choice: KVLayout = SMALL, **kwargs: Any) -> Iterator[DecodeWorker]:
    kwargs = {"read_timeout_s": READ_TIMEOUT_S, "handshake_timeout_s": 5.0} | kwargs
    with make_decode(choice, transport="nixl", **kwargs) as worker:
        yield worker


def assert_decode_clean(decode: DecodeWorker) -> None:
    assert decode.pool.num_free == decode.layout.num_blocks - 1, "decode leaked blocks"
    assert decode.transport.num_open_handles == 0, "decode leaked NIXL handles"
    assert decode.num_draining == 0 and decode.num_pending == 0


def wait_prefill_free(addr: tuple[str, int], num_blocks: int,
                      timeout_s: float = LEASE_S + 8) -> m.Stats:
    deadline = time.monotonic() + timeout_s
    s = stats_of(addr)
    while s.held_requests and time.monotonic() < deadline:
        time.sleep(0.05)
        s = stats_of(addr)
    assert s.held_requests == 0 and s.free_blocks == num_blocks - 1, f"prefill leaked: {s}"
    assert s.prefilled == s.completed + s.released + s.expired and s.open_handles == 0, s
    return s


def assert_request_works(decode: DecodeWorker, addr: tuple[str, int], rid: str,
                         tokens: int = 300, seed: int = 77) -> None:
    done = prefill_request(addr, rid, tokens=tokens, seed=seed)
    res = finish_read(decode, decode.start(rid, addr, done.block_ids,
                                           capability=done.capability))
    assert res.ok, res.reason
    assert verify_request(decode.cache, res.local_block_ids, seed) == []
    decode.finish(rid)
    assert_decode_clean(decode)


def kill_on_read(decode: DecodeWorker, child: PrefillProcess, delay_s: float | None) -> None:
    """Wrap decode's transport.read: SIGKILL the prefill child right before the READ is
    posted (``delay_s`` None: and wait until it is dead) or ``delay_s`` after."""
    original = decode.transport.read

    def read(*args: Any) -> int:
        if delay_s is None:
            child.kill()
        else:
            threading.Timer(delay_s, lambda: os.kill(child.pid, signal.SIGKILL)).start()
        return original(*args)

    decode.transport.read = read  # type: ignore[method-assign,assignment]


# ------------------------------------------------------------------------ prefill dies
@pytest.mark.timeout(180)
def test_prefill_killed_before_the_read_then_restarted_on_the_same_port() -> None:
    with decoder() as decode:
        first = PrefillProcess(SMALL, transport="nixl", lease_s=LEASE_S)
        try:
            addr = first.wait_ready()
            assert_request_works(decode, addr, "warm")  # connected, UCX endpoint up
            done = prefill_request(addr, "doomed", 200)
            kill_on_read(decode, first, delay_s=None)  # dies after Acquire, before READ
            res = finish_read(decode, decode.start("doomed", addr, done.block_ids,
                                                   capability=done.capability))
        finally:
            first.kill()
        assert res.status == "failed", res
        assert res.code == TransportFailure.code and "NIXL" in res.reason
        assert "NIXL_ERR_REMOTE_DISCONNECT" in res.reason or "NIXL_ERR" in res.reason
        del decode.transport.read  # unwrap
        assert_decode_clean(decode)
        # a never-connected decode sees a dead side channel as a bounded timeout
        with decoder(handshake_timeout_s=0.5) as fresh, pytest.raises(HandshakeTimeout):
            fresh.connect(*addr)
        # prefill restarts on the same address: a new agent; decode handshakes again
        with prefill_child(port=addr[1]) as second:
            assert second.address == addr
            assert_request_works(decode, addr, "after-restart")
            assert_request_works(decode, addr, "after-restart-2", seed=78)
            wait_prefill_free(addr, SMALL.num_blocks)


LARGE = preset("llama-3.1-8b", num_blocks=80, block_size=16)  # 2 MiB a block


@pytest.mark.timeout(180)
def test_prefill_killed_during_a_large_read() -> None:
    """64+ MiB READ; prefill is SIGKILLed a few ms after it was posted. Either the READ
    fails with a reason, or it had already completed, and then every byte must be
    right: never DONE with wrong bytes."""
    with decoder(LARGE, read_timeout_s=5.0) as decode, prefill_child(LARGE, lease_s=10.0) as c:
        addr = c.address
        assert addr is not None
        assert_request_works(decode, addr, "warm", tokens=16)
        done = prefill_request(addr, "big", tokens=1200, seed=9)  # 75 blocks, 150 MiB
        kill_on_read(decode, c, delay_s=0.003)
        res = finish_read(decode, decode.start("big", addr, done.block_ids,
                                               capability=done.capability))
        print(f"killed during READ -> {res.status}: {res.reason[:160]}")  # shown with -s
        if res.status == "done":
            assert verify_request(decode.cache, res.local_block_ids, 9) == []
            decode.finish("big")
        else:
            assert res.status == "failed" and res.reason, res
        assert_decode_clean(decode)
        c.kill()
        del decode.transport.read
        # the dead peer's READ fails fast and leaks nothing either
        res = decode.start("big2", addr, done.block_ids, capability=done.capability)
        assert res.status == "failed"
        assert_decode_clean(decode)


# ------------------------------------------------------------------------ decode dies
def _decode_child(conn: Connection, choice: KVLayout, addr: tuple[str, int]) -> None:
    """Read one request fully (notification frees it), then prefill + Acquire a second
    one and report; the parent SIGKILLs this process while prefill holds its blocks."""
    worker = make_decode(choice, transport="nixl", read_timeout_s=READ_TIMEOUT_S)
    done = call(addr, m.PrefillRequest(request_id="child-ok", num_tokens=64, seed=3))
    assert isinstance(done, m.PrefillDone)
    res = worker.start("child-ok", addr, done.block_ids, capability=done.capability)
    while res.status == "pending":
        worker.poll()
    held = call(addr, m.PrefillRequest(request_id="child-held", num_tokens=400, seed=4))
    assert isinstance(held, m.PrefillDone)
    lease = call(addr, m.Acquire(request_id="child-held", capability=held.capability))
    conn.send((res.status, isinstance(lease, m.Lease)))
    time.sleep(120)  # killed long before


@pytest.mark.timeout(180)
def test_decode_killed_while_prefill_holds_blocks() -> None:
    with prefill_child() as child:
        addr = child.address
        assert addr is not None
        ctx = mp.get_context("spawn")
        parent, conn = ctx.Pipe()
        proc = ctx.Process(target=_decode_child, args=(conn, SMALL, addr), daemon=True)
        proc.start()
        try:
            assert parent.poll(90), "decode child did not report"
            assert parent.recv() == ("done", True)
            assert stats_of(addr).held_requests == 1
            os.kill(proc.pid or 0, signal.SIGKILL)
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        s = wait_prefill_free(addr, SMALL.num_blocks)
        assert (s.completed, s.expired) == (1, 1)  # the lease freed the dead decode's blocks
        with decoder() as decode:  # prefill keeps serving a new decode
            assert_request_works(decode, addr, "next")
        assert wait_prefill_free(addr, SMALL.num_blocks).completed == 2


# ------------------------------------------------------------------------ NIXL error state
@pytest.mark.timeout(120)
def test_read_beyond_the_remote_region_and_abort() -> None:
    with decoder() as decode, prefill_child() as child:
        addr = child.address
        assert addr is not None
        remote = decode.connect(*addr)
        # a remote whose host buffer "moved": descriptors fall past prefill's registration
        decode._remotes[addr] = dataclasses.replace(remote, base=remote.base + (1 << 40))
        done = prefill_request(addr, "beyond", 200)
        res = finish_read(decode, decode.start("beyond", addr, done.block_ids,
                                               capability=done.capability))
        assert res.status == "failed"
        assert "NIXL refused the READ" in res.reason and "NIXL_ERR_NOT_FOUND" in res.reason
        assert_decode_clean(decode)
        assert addr not in decode._remotes  # the bad handshake is dropped ...
        assert_request_works(decode, addr, "after")  # ... and the next request works
        # abort with real NIXL: aborted, handle released, prefill frees once
        done = prefill_request(addr, "aborted", 200)
        decode.start("aborted", addr, done.block_ids, capability=done.capability)
        res = decode.abort("aborted", reason="caller gave up")
        assert (res.status, res.reason) == ("aborted", "caller gave up")
        deadline = time.monotonic() + 10  # a READ still in flight is quarantined until over
        while decode.num_draining and time.monotonic() < deadline:
            decode.poll()
            time.sleep(0.01)
        assert_decode_clean(decode)
        s = wait_prefill_free(addr, SMALL.num_blocks)
        assert s.expired == 1 and s.completed + s.released == 2
        assert_request_works(decode, addr, "last", seed=5)
