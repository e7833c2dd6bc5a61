"""End-to-end checksums (``verify_checksum``): prefill digests at d2h, decode checks them
after the READ and before the h2d. Loopback transport, prefill served from a thread."""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from kvstage.errors import InvalidRequest, LayoutMismatch
from kvstage.pd import integrity
from kvstage.pd.decode import CHECKSUM_MISMATCH, CHECKSUM_MISSING, DecodeWorker
from kvstage.pd.prefill import PrefillWorker
from kvstage.pd.reads import pair_blocks
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillThread, make_decode, make_prefill
from tests.helpers import prefill_request

pytest.importorskip("xxhash")

GEMMA = preset("gemma-3-1b", num_blocks=1024)


@contextmanager
def pair(prefill_checks: bool = True, decode_checks: bool = True,
         **decode_kw: Any) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = make_prefill(GEMMA, transport="loopback", verify_checksum=prefill_checks)
    with PrefillThread(prefill), make_decode(
        GEMMA, transport="loopback", verify_checksum=decode_checks, read_timeout_s=5.0,
        **decode_kw,
    ) as decode:
        yield prefill, decode


def held(prefill: PrefillWorker, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while prefill.num_held and time.monotonic() < deadline:
        time.sleep(0.01)
    return prefill.num_held


def test_checksums_travel_and_a_clean_read_passes() -> None:
    with pair() as (prefill, decode):
        done = prefill_request(prefill.address, "r", 700, 3)
        assert [len(c) for c in done.checksums] == [len(g) for g in done.block_ids]
        want = [integrity.block_digests(prefill.host, g) for g in done.block_ids]
        assert done.checksums == want
        res = decode.start("r", prefill.address, done.block_ids, capability=done.capability)
        res = decode.wait("r", 10.0)
        assert res.ok, res.reason
        assert verify_request(decode.cache, res.local_block_ids, 3) == []
        decode.finish("r")
        # a prefix decode already holds: only the suffix is read, and checked
        done = prefill_request(prefill.address, "trim", 700, 4)
        local = [decode.pool.allocate(len(g) // 2) for g in done.block_ids]
        res = decode.start("trim", prefill.address, done.block_ids, local,
                           capability=done.capability)
        res = decode.wait("trim", 10.0)
        assert res.ok, res.reason
        skips = [len(g) - len(g) // 2 for g in done.block_ids]
        for g, (ids, skip) in enumerate(zip(local, skips, strict=True)):
            groups: list[list[int]] = [[] for _ in local]
            groups[g] = ids
            assert verify_request(decode.cache, groups, 4, skip=skip) == []


def test_a_corrupted_read_fails_and_nothing_reaches_the_device() -> None:
    with pair() as (prefill, decode):
        done = prefill_request(prefill.address, "bad", 500, 5)
        original = decode.transport.read

        def read_and_flip(peer: str, local: np.ndarray, remote: np.ndarray,
                          notif: bytes) -> int:
            handle = original(peer, local, remote, notif)  # loopback: bytes moved already
            addr = int(local[-1, 0]) + int(local[-1, 1]) // 2  # one byte mid-way of a run
            byte = ctypes.c_uint8.from_address(addr)
            byte.value ^= 0x01
            return handle

        decode.transport.read = read_and_flip  # type: ignore[method-assign]
        free_before = decode.pool.num_free
        device_before = decode.cache.canonical.clone()  # type: ignore[union-attr]
        res = decode.start("bad", prefill.address, done.block_ids, capability=done.capability)
        res = decode.wait("bad", 10.0)
        del decode.transport.read
        assert (res.status, res.code) == ("failed", CHECKSUM_MISMATCH)
        assert res.reason.startswith("checksum mismatch: 1 of ")
        assert "nothing of them was loaded to the device" in res.reason
        assert decode.cache.canonical.equal(device_before)  # type: ignore[union-attr]
        # the READ was DONE: nothing of it can still write, its blocks go back
        assert decode.pool.num_free == free_before
        assert decode.num_draining == 0 and decode.transport.num_open_handles == 0
        assert held(prefill) == 0  # the completion notification freed it at prefill
        # the next request is fine
        done = prefill_request(prefill.address, "good", 500, 6)
        decode.start("good", prefill.address, done.block_ids, capability=done.capability)
        res = decode.wait("good", 10.0)
        assert res.ok and verify_request(decode.cache, res.local_block_ids, 6) == []


def test_decode_checks_but_prefill_sends_no_checksums() -> None:
    with pair(prefill_checks=False) as (prefill, decode):
        done = prefill_request(prefill.address, "r", 300, 7)
        assert done.checksums == []
        free_before = decode.pool.num_free
        res = decode.start("r", prefill.address, done.block_ids, capability=done.capability)
        assert (res.status, res.code) == ("failed", CHECKSUM_MISSING)
        assert "--verify-checksum" in res.reason
        assert decode.pool.num_free == free_before
        assert held(prefill) == 0  # released at once, not at lease expiry
        assert prefill.counters.released == 1


def test_checksums_off_by_default() -> None:
    with pair(prefill_checks=False, decode_checks=False) as (prefill, decode):
        done = prefill_request(prefill.address, "r", 300, 8)
        assert done.checksums == []
        decode.start("r", prefill.address, done.block_ids, capability=done.capability)
        assert decode.wait("r", 10.0).ok


def test_mirror_host_layout_digests_match_block_major() -> None:
    from kvstage.cache import HostBuffer, HostLayout, KVCache
    from kvstage.engine import CopyEngine

    cache = KVCache(GEMMA)
    cache.fill_random(1)
    digests = []
    for hl in (HostLayout.BLOCK_MAJOR, HostLayout.MIRROR):
        host = HostBuffer(GEMMA, hl)
        CopyEngine(cache, host).save_to_host([[1, 2, 3]] + [[] for _ in GEMMA.groups[1:]])
        digests.append(integrity.block_digests(host, [1, 2, 3, 0]))
    assert digests[0][3] == digests[1][3] == 0
    assert len(set(digests[0][:3])) == 3 and len(set(digests[1][:3])) == 3


def test_params_form_round_trips_through_json_and_refuses_garbage() -> None:
    """The JSON form the vLLM connector hands over in ``kv_transfer_params``."""
    digests = {7: 2**64 - 1, 9: 0, 12: 12345}
    wire = json.loads(json.dumps(integrity.to_params(digests)))
    assert wire == {"xxh3_64": {"7": "ffffffffffffffff", "9": "0000000000000000",
                                "12": "0000000000003039"}}
    assert integrity.from_params(wire) == digests
    for bad in (None, 3, "x", {}, {"xxh3_64": {"7": "zz"}}, {"xxh3_64": [1]}, {"md5": {}}):
        assert integrity.from_params(bad) is None


def test_mismatches_name_the_pairs_that_differ() -> None:
    pairs = [(4, 1), (5, 2), (6, 3)]
    assert integrity.mismatches(pairs, {4: 10, 5: 11, 6: 12}, [10, 99, 12]) == [(5, 2)]
    assert integrity.mismatches(pairs, {4: 10}, [10, 11, 12]) == [(5, 2), (6, 3)]
    assert integrity.mismatches(pairs, None, []) == pairs


def test_pairing_is_end_aligned_strict_for_the_cli_lenient_for_vllm() -> None:
    remote, local = [[3, 4, 5], [0, 8]], [[11, 12], [0, 9]]
    want = [(0, 4, 11), (0, 5, 12), (1, 8, 9)]
    assert pair_blocks(remote, local) == want
    assert pair_blocks(remote, local, lenient=True) == want
    with pytest.raises(InvalidRequest, match="group 0: 3 local blocks for 2 remote ones"):
        pair_blocks([[1, 2]], [[5, 6, 7]])
    assert pair_blocks([[1, 2]], [[5, 6, 7]], lenient=True) == [(0, 1, 6), (0, 2, 7)]
    with pytest.raises(InvalidRequest, match=r"null block paired with a real one \(0 -> 7\)"):
        pair_blocks([[0, 2]], [[7, 8]])
    assert pair_blocks([[0, 2]], [[7, 8]], lenient=True) == [(0, 2, 8)]
    with pytest.raises(LayoutMismatch, match="remote has 1 id lists, local 2"):
        pair_blocks([[1]], [[1], [2]])
    assert pair_blocks([[1]], [[1], [2]], lenient=True) == [(0, 1, 1)]
