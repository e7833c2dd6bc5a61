"""The decode pipeline over real NIXL (UCX on 127.0.0.1): chunked READs byte-exact, the
completion notification sent once after the last chunk, and a fault in a middle chunk.
Prefill in a child process (stopped in ``finally``); every wait bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstage.errors import TransportFailure
from kvstage.pd import messages as m
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillProcess, make_decode
from tests.helpers import finish_read, prefill_request, start_request, stats_of

pytestmark = pytest.mark.nixl

LARGE = preset("llama-3.1-8b", num_blocks=80, block_size=16)  # 2 MiB a block
LEASE_S = 10.0


def stats_when_free(addr: tuple[str, int], timeout_s: float = LEASE_S + 10) -> m.Stats:
    deadline = time.monotonic() + timeout_s
    s = stats_of(addr)
    while s.held_requests and time.monotonic() < deadline:
        time.sleep(0.05)
        s = stats_of(addr)
    assert s.held_requests == 0 and s.free_blocks == LARGE.num_blocks - 1, s
    return s


@pytest.mark.timeout(300)
def test_pipelined_decode_over_nixl_with_a_fault_in_a_middle_chunk() -> None:
    with PrefillProcess(LARGE, transport="nixl", lease_s=LEASE_S) as child, make_decode(
        LARGE, transport="nixl", read_timeout_s=8.0, handshake_timeout_s=20.0, pipeline=True
    ) as decode:
        addr = child.wait_ready()
        res = finish_read(decode, start_request(decode, addr, "big", 32 * 16, 3,
                                                timeout_s=30.0), 30.0)  # 64 MiB: 4 chunks
        assert res.ok, res.reason
        assert (res.num_chunks, res.num_descriptors) == (4, 4)
        assert verify_request(decode.cache, res.local_block_ids, 3) == []
        decode.finish("big")
        s = stats_when_free(addr)
        assert (s.completed, s.expired, s.num_unknown_notifs) == (1, 0, 0)  # notified once

        # chunk 2 of 4 points past prefill's registration: NIXL refuses it when posted
        original, posts = decode.transport.read, []

        def read(peer: str, local: np.ndarray, remote: np.ndarray, notif: bytes) -> int:
            posts.append(len(local))
            if len(posts) == 2:
                remote = remote.copy()
                remote[:, 0] += 1 << 40
            return original(peer, local, remote, notif)

        decode.transport.read = read  # type: ignore[method-assign]
        res = finish_read(decode, start_request(decode, addr, "bad", 32 * 16, 4,
                                                timeout_s=30.0), 30.0)
        del decode.transport.read
        assert res.status == "failed" and res.code == TransportFailure.code, res
        assert "NIXL_ERR_NOT_FOUND" in res.reason
        assert len(posts) == 2  # nothing posted after the faulty chunk
        deadline = time.monotonic() + 10  # chunk 1, if still in flight, is quarantined
        while decode.num_draining and time.monotonic() < deadline:
            decode.poll()
            time.sleep(0.005)
        assert decode.pool is not None and decode.pool.num_free == LARGE.num_blocks - 1
        assert decode.transport.num_open_handles == 0 and decode.num_draining == 0
        s = stats_when_free(addr)  # no notification for a failed request: the lease frees it
        assert (s.completed, s.expired) == (1, 1)

        res = finish_read(decode, start_request(decode, addr, "next", 32 * 16, 5,
                                                timeout_s=30.0), 30.0)
        assert res.ok and res.num_chunks == 4, res.reason
        assert verify_request(decode.cache, res.local_block_ids, 5) == []
        decode.finish("next")
        assert stats_when_free(addr).completed == 2


@pytest.mark.timeout(300)
def test_prepared_descriptor_lists_are_byte_exact() -> None:
    """``prepared_reads``: block rows prepared once per side, READs by index (NIXL
    ``make_prepped_xfer``), contiguous and scattered local ids, one READ and pipelined."""
    from kvstage.pd.reads import Poster

    with PrefillProcess(LARGE, transport="nixl", lease_s=LEASE_S) as child, make_decode(
        LARGE, transport="nixl", read_timeout_s=8.0, handshake_timeout_s=20.0
    ) as decode:
        addr = child.wait_ready()
        decode.poster = Poster(decode.transport, decode.host, prepared=True)
        assert decode.pool is not None
        for i, (pipeline, scattered) in enumerate([(False, False), (True, False),
                                                   (False, True), (True, True)]):
            decode.pipeline = pipeline
            done = prefill_request(addr, f"p{i}", 20 * 16, 30 + i, timeout_s=30.0)
            local, taken = None, []
            if scattered:  # every pair its own run: 20 indices, no two adjacent
                taken = decode.pool.allocate(40)
                local = [taken[::-2]]
            res = finish_read(decode, decode.start(f"p{i}", addr, done.block_ids, local,
                                                   capability=done.capability), 30.0)
            assert res.ok, res.reason
            assert verify_request(decode.cache, res.local_block_ids, 30 + i) == []
            if local is None:
                decode.finish(f"p{i}")
            else:
                decode.pool.free(taken)
        assert len(decode.transport._state.preps) == 2  # type: ignore[attr-defined]
        assert stats_when_free(addr).completed == 4
