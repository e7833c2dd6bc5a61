"""Quarantine of a READ that may still write (loopback's ``stall_reads`` + ``resume_reads``
model UCX tcp with a stalled peer: a released READ still lands on resume). The real-NIXL
reproduction (SIGSTOP/SIGCONT) is tests/system/test_late_bytes_nixl.py."""

from __future__ import annotations

from typing import Any

import pytest

from kvstage.blocks import GroupedBlockIds
from kvstage.errors import InvalidRequest, PoolExhausted
from kvstage.pd.decode import ABORTED, READ_TIMEOUT
from kvstage.pd.pipeline import WINDOW
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillThread, make_decode, make_prefill
from tests.helpers import start_request

LAYOUT = preset("llama-3.1-8b", num_blocks=64, block_size=16)  # one group
K = 8


@pytest.mark.parametrize("how", ["timeout", "abort"])
def test_a_stalled_read_keeps_its_blocks_until_it_is_over(how: str) -> None:
    prefill = make_prefill(LAYOUT, transport="loopback", lease_s=30.0)
    with PrefillThread(prefill), make_decode(LAYOUT, transport="loopback",
                                             read_timeout_s=0.2) as decode:
        addr = prefill.address
        t: Any = decode.transport
        assert decode.pool is not None
        filler = decode.pool.allocate(decode.pool.num_free - K)  # r1 takes the last K
        t.stall_reads = True
        r1 = start_request(decode, addr, "r1", K * 16, 1)
        t.stall_reads = False
        assert r1.status == "pending", r1
        if how == "abort":
            r1 = decode.abort("r1")
            assert (r1.status, r1.code) == ("aborted", ABORTED)
        else:
            r1 = decode.wait("r1", 5.0)
            assert (r1.status, r1.code) == ("failed", READ_TIMEOUT)
        ids = r1.local_block_ids[0]
        assert decode.num_draining == 1 and decode.pool.num_free == 0
        assert all(decode.in_flight(b) for b in ids)
        with pytest.raises(PoolExhausted):  # nothing else to hand out
            start_request(decode, addr, "r2", K * 16, 2)
        decode.pool.free(filler[:K])
        with pytest.raises(InvalidRequest, match="in flight"):  # engine ids: refused too
            start_request(decode, addr, "r3", K * 16, 3, local=[ids])
        r4 = start_request(decode, addr, "r4", K * 16, 4)
        r4 = decode.wait("r4", 5.0) if r4.status == "pending" else None
        assert r4 is not None and r4.ok and not set(r4.local_block_ids[0]) & set(ids)
        # r1's late bytes land (every chunk posted: the window), in r1's rows only
        assert t.resume_reads() == min(WINDOW, r1.num_chunks)
        decode.poll()
        assert decode.num_draining == 0 and t.num_open_handles == 0
        assert not any(decode.in_flight(b) for b in ids)
        decode.engine.load_to_device(GroupedBlockIds(r4.local_block_ids, LAYOUT))
        assert verify_request(decode.cache, r4.local_block_ids, 4) == []
        decode.finish("r4")
        decode.pool.free(filler[K:])
        assert decode.pool.num_free == LAYOUT.num_blocks - 1
