"""Late bytes of a timed-out READ (real NIXL, UCX tcp, prefill SIGSTOPped at the post).

UCX over tcp keeps the GET of a stalled peer alive: when the peer resumes, the rest of
its bytes are written into decode's host rows even after NIXL released the handle (and
even after ``remove_remote_agent``). The guarantee under test: those rows (= decode's
local block ids, block-major host buffer) are handed to no other request until the
transfer is over, so a later request from a healthy prefill stays byte-exact.

The prefill is stopped right before the READ is posted (after its Acquire was answered)
and the post waits until the kernel shows it stopped: no byte can arrive before the
deadline, every byte arrives late. (Stopping it a few ms after the post raced the
transfer: with idle-sleeping progress threads a 60 MiB tcp READ sometimes finished first,
one fresh-clone CI failure.) Children are SIGCONTed and stopped in ``finally``; every
wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvstage.blocks import GroupedBlockIds
from kvstage.errors import PoolExhausted
from kvstage.pd.decode import READ_TIMEOUT, DecodeWorker, RequestResult
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillProcess, make_decode
from tests.helpers import finish_read, prefill_request, start_request

pytestmark = pytest.mark.nixl

LARGE = preset("llama-3.1-8b", num_blocks=80, block_size=16)  # 2 MiB a block
K = 30  # blocks of the stalled request: 60 MiB, far from done 5 ms after the post
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


@contextlib.contextmanager
def children(n: int, **options: Any) -> Iterator[list[PrefillProcess]]:
    procs = [PrefillProcess(LARGE, transport="nixl", **options) for _ in range(n)]
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGCONT)
            p.stop()


def settle(decode: DecodeWorker, seconds: float, until_drained: float = 0.0) -> None:
    """Poll for ``seconds`` (late bytes land meanwhile), and on until nothing is
    quarantined, at most ``until_drained`` more seconds."""
    start = time.monotonic()
    while time.monotonic() - start < seconds or (
        decode.num_draining and time.monotonic() - start < seconds + until_drained
    ):
        decode.poll()
        time.sleep(0.01)


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until /proc says ``pid`` is stopped (state T), bounded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} not stopped {timeout_s} s after SIGSTOP")


def reloaded_ok(decode: DecodeWorker, res: RequestResult, seed: int) -> list[str]:
    """h2d the request's host rows again and compare with the pattern: what its KV would
    be had the late bytes landed before the load."""
    decode.engine.load_to_device(GroupedBlockIds(res.local_block_ids, decode.layout))
    return verify_request(decode.cache, res.local_block_ids, seed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pipeline", [False, True], ids=["one-read", "pipelined"])
def test_late_bytes_of_a_timed_out_read_never_reach_another_request(
    monkeypatch: pytest.MonkeyPatch, pipeline: bool,
) -> None:
    for key, value in TCP.items():  # this process and the spawned children
        monkeypatch.setenv(key, value)
    with children(2, lease_s=60.0) as (stalled, healthy), make_decode(
        LARGE, transport="nixl", read_timeout_s=2.0, handshake_timeout_s=10.0,
        pipeline=pipeline,
    ) as decode:
        a, b = stalled.wait_ready(), healthy.wait_ready()
        for addr, rid in ((a, "warm-a"), (b, "warm-b")):  # endpoints up, pages touched
            res = finish_read(decode, start_request(decode, addr, rid, 2 * 16, 1, timeout_s=30.0),
                              30.0)
            assert res.ok, res.reason
            decode.finish(rid)
        assert decode.pool is not None
        filler = decode.pool.allocate(decode.pool.num_free - K)  # r1 takes the last K
        r1_done = prefill_request(a, "r1", K * 16, seed=5, timeout_s=30.0)
        original = decode.transport.read

        def stop_then_read(*args: Any) -> int:
            os.kill(stalled.pid, signal.SIGSTOP)
            wait_stopped(stalled.pid)
            return original(*args)

        decode.transport.read = stop_then_read  # type: ignore[method-assign]
        r1 = decode.start("r1", a, r1_done.block_ids, capability=r1_done.capability)
        del decode.transport.read
        r1 = finish_read(decode, r1, 30.0)
        assert (r1.status, r1.code) == ("failed", READ_TIMEOUT), r1
        r1_ids = sorted(r1.local_block_ids[0])
        assert len(r1_ids) == K

        # the next request, from the healthy prefill, needs K blocks
        r2: RequestResult | None
        try:
            r2 = start_request(decode, b, "r2", K * 16, seed=6, timeout_s=30.0)
        except PoolExhausted:
            r2 = None  # r1's blocks are still quarantined: nothing else to hand out
        if r2 is not None:
            r2 = finish_read(decode, r2, 30.0)
        os.kill(stalled.pid, signal.SIGCONT)  # the late bytes of r1 now arrive
        settle(decode, 3.0, until_drained=30.0)
        if r2 is not None:  # r2 got blocks: they must still hold r2's KV, byte for byte
            assert r2.ok, r2.reason
            assert reloaded_ok(decode, r2, 6) == []
        assert r2 is None, "r1's blocks were handed out while its READ could still write"
        # the stalled READ is over: its blocks go back to the pool, exactly once
        assert decode.num_draining == 0 and decode.transport.num_open_handles == 0
        assert not any(decode.in_flight(blk) for blk in r1_ids)
        assert decode.pool.num_free == K
        r3 = finish_read(decode, start_request(decode, b, "r3", K * 16, seed=7, timeout_s=30.0),
                        30.0)
        assert r3.ok, r3.reason
        assert sorted(r3.local_block_ids[0]) == r1_ids  # the very rows r1 was reading
        settle(decode, 1.0)
        assert reloaded_ok(decode, r3, 7) == []
        decode.finish("r3")
        decode.pool.free(filler)
        assert decode.pool.num_free == LARGE.num_blocks - 1
