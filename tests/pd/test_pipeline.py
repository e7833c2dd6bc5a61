"""Decode pipeline (`kvstage.pd.pipeline`): chunking, byte-exact multi-chunk READs, and a
fault in a middle chunk (loopback transport; the real-NIXL version is
tests/system/test_pipeline_nixl.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvstage.pd import decode as decode_mod
from kvstage.pd.decode import READ_FAILED, READ_TIMEOUT, DecodeWorker
from kvstage.pd.pipeline import (
    ACROSS_HOSTS_WINDOW,
    MAX_CHUNKS,
    MIN_CHUNK_BYTES,
    WINDOW,
    split_runs,
    window_for,
)
from kvstage.pd.prefill import PrefillWorker
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillThread, make_decode, make_prefill
from tests.helpers import start_request

LAYOUT = preset("llama-3.1-8b", num_blocks=96, block_size=16)  # 2 MiB a block, one group
MIB = 1 << 20


def test_split_runs_cuts_whole_blocks_in_order() -> None:
    runs = np.array([[10, 1, 3], [20, 7, 5], [40, 30, 8]], np.int64)  # 16 blocks
    chunks = split_runs(runs, 2 * MIB)  # 32 MiB: 4 chunks of 4 blocks
    assert [c.tolist() for c in chunks] == [
        [[10, 1, 3], [20, 7, 1]], [[21, 8, 4]], [[40, 30, 4]], [[44, 34, 4]],
    ]
    assert [c.tolist() for c in split_runs(runs, MIN_CHUNK_BYTES // 16)] == [runs.tolist()]
    assert split_runs(np.zeros((0, 3), np.int64), MIB) == []
    one = split_runs(np.array([[5, 5, 3]], np.int64), 3 * MIN_CHUNK_BYTES)  # 3 blocks
    assert [c.tolist() for c in one] == [[[5, 5, 1]], [[6, 6, 1]], [[7, 7, 1]]]


@contextmanager
def pair(**decode_kw: Any) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = make_prefill(LAYOUT, transport="loopback", lease_s=2.0)
    with PrefillThread(prefill), make_decode(LAYOUT, transport="loopback", pipeline=True,
                                             read_timeout_s=0.5, **decode_kw) as decode:
        yield prefill, decode


def finish(decode: DecodeWorker, res: Any) -> Any:
    return decode.wait(res.request_id, 10.0) if res.status == "pending" else res


def settle(prefill: PrefillWorker, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while prefill.num_held and time.monotonic() < deadline:
        time.sleep(0.01)


def assert_clean(decode: DecodeWorker) -> None:
    assert decode.pool is not None and decode.pool.num_free == LAYOUT.num_blocks - 1
    assert decode.transport.num_open_handles == 0
    assert decode.num_pending == 0 and decode.num_draining == 0


def test_pipelined_read_is_byte_exact_and_notifies_once() -> None:
    with pair() as (prefill, decode):
        res = finish(decode, start_request(decode, prefill.address, "big", 24 * 16, 3))  # 48 MiB
        assert res.ok, res.reason
        assert res.num_chunks == 4 and res.num_descriptors == 4
        assert verify_request(decode.cache, res.local_block_ids, 3) == []
        decode.finish("big")
        settle(prefill)
        c = prefill.counters
        assert (c.completed, c.expired, c.num_unknown_notifs, prefill.num_held) == (1, 0, 0, 0)
        assert_clean(decode)


@pytest.mark.parametrize("fault", ["fail_reads", "stall_reads"])
def test_a_fault_in_a_middle_chunk_fails_the_request(fault: str) -> None:
    with pair() as (prefill, decode):
        t: Any = decode.transport
        original, posts = t.read, []

        def read(*args: Any) -> int:
            posts.append(args)
            setattr(t, fault, len(posts) == 2)  # the second chunk only
            try:
                return original(*args)
            finally:
                setattr(t, fault, False)

        t.read = read
        res = finish(decode, start_request(decode, prefill.address, "bad", 24 * 16, 4))
        del t.read
        assert res.status == "failed" and res.num_chunks == 4
        assert res.code == (READ_FAILED if fault == "fail_reads" else READ_TIMEOUT)
        assert len(posts) == 2  # nothing posted after the faulty chunk (WINDOW is 1)
        ids = [b for g in res.local_block_ids for b in g]
        if fault == "stall_reads":  # chunk 1 may still write: every id stays quarantined
            assert decode.num_draining == 1 and all(decode.in_flight(b) for b in ids)
            assert t.resume_reads() == 1
            decode.poll()
        assert_clean(decode)
        settle(prefill)  # the lease frees the failed request at prefill
        assert prefill.num_held == 0 and prefill.counters.completed == 0
        res = finish(decode, start_request(decode, prefill.address, "next", 24 * 16, 5))
        assert res.ok and res.num_chunks == 4
        assert verify_request(decode.cache, res.local_block_ids, 5) == []


def test_window_is_one_chunk_on_loopback_and_every_chunk_across_hosts() -> None:
    assert WINDOW == 1 and ACROSS_HOSTS_WINDOW == MAX_CHUNKS
    for host in ("127.0.0.1", "127.9.9.9", "::1", "localhost"):
        assert window_for(host) == 1, host
    for host in ("10.79.0.1", "0.0.0.0", "fe80::1", "prefill.example"):
        assert window_for(host) == MAX_CHUNKS, host


@pytest.mark.parametrize("fault", [None, "fail_reads"])
def test_across_hosts_every_chunk_is_posted_at_once(monkeypatch: pytest.MonkeyPatch,
                                                    fault: str | None) -> None:
    # the loopback pair posing as two hosts: the decode picks the window from the address
    monkeypatch.setattr(decode_mod, "window_for", lambda host: ACROSS_HOSTS_WINDOW)
    with pair() as (prefill, decode):
        t: Any = decode.transport
        original, posts, in_flight = t.read, [], []

        def read(*args: Any) -> int:
            posts.append(args)
            in_flight.append(decode.transport.num_open_handles)
            # chunks 1-3 wait for chunk 4's post, but for chunk 2 when it is the faulty one
            faulty = bool(fault) and len(posts) == 2
            t.stall_reads = len(posts) < 4 and not faulty
            if fault:
                setattr(t, fault, faulty)
            try:
                return original(*args)
            finally:
                t.stall_reads = False
                if fault:
                    setattr(t, fault, False)

        t.read = read
        res = start_request(decode, prefill.address, "wide", 24 * 16, 6)
        assert len(posts) == 4 and in_flight == [0, 1, 2, 3]  # all four before any is done
        t.resume_reads()
        res = finish(decode, res)
        del t.read
        if fault is None:
            assert res.ok and res.num_chunks == 4, res.reason
            assert verify_request(decode.cache, res.local_block_ids, 6) == []
            decode.finish("wide")
        else:
            assert res.status == "failed" and res.code == READ_FAILED
        decode.poll()
        assert_clean(decode)


@pytest.mark.gpu
def test_pipelined_read_on_cuda_uses_the_copy_stream_and_is_byte_exact() -> None:
    import torch

    with pair(device="cuda") as (prefill, decode):
        assert decode.loader.cuda
        res = finish(decode, start_request(decode, prefill.address, "gpu", 24 * 16, 6))
        assert res.ok and res.num_chunks == 4, res.reason
        torch.cuda.synchronize()
        assert verify_request(decode.cache, res.local_block_ids, 6) == []
        decode.finish("gpu")
        assert_clean(decode)
