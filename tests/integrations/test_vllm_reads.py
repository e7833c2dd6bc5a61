"""Merged READ descriptors (`kvstage.integrations.vllm.reads`) on real NIXL agents.

Two NIXL agents in this process (UCX over loopback), each with a host buffer of R regions
x NB blocks registered, and descriptor lists prepared the way vLLM 0.32.0's worker prepares
them: one row per (region, block), region-major, ``[N, 3]`` uint64 (addr, len, device),
``get_xfer_descs`` then ``prep_xfer_dlist``; READs posted as vLLM posts them,
``make_prepped_xfer("READ", local, local_ids, remote, remote_ids, notif_msg=...)`` with
``ids = region * NB + block`` for every region. Through `MergedReads`: the bytes land as
with vLLM's per-block READ (pairs checked block by block, the rest of the buffer
untouched), the peer gets the same notification, and exactly runs x regions descriptor
pairs reach NIXL (runs from kvstage's `find_runs` over the (remote, local) block pairs).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvstage.integrations.vllm.reads import MergedReads, install_merged_reads, merge_descs
from kvstage.plan import find_runs

REGIONS, NB, PAGE = 3, 40, 256


def test_merge_descs_joins_only_what_continues_on_both_sides() -> None:
    local = np.array([[100, 8, 0], [108, 8, 0], [116, 8, 0], [200, 8, 0]], dtype=np.uint64)
    remote = np.array([[500, 8, 0], [508, 8, 0], [600, 8, 0], [608, 8, 0]], dtype=np.uint64)
    lm, rm = merge_descs(local, remote)
    assert lm.tolist() == [[100, 16, 0], [116, 8, 0], [200, 8, 0]]
    assert rm.tolist() == [[500, 16, 0], [600, 8, 0], [608, 8, 0]]
    other_dev = local.copy()
    other_dev[1, 2] = 1
    assert len(merge_descs(other_dev, remote)[0]) == 4
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        merge_descs(local, remote[:3])


def test_merge_prepared_equals_merge_descs_on_vllm_lists() -> None:
    """The per-READ fast path gives `merge_descs`'s result on region-major lists."""
    from kvstage.integrations.vllm.reads import _continues, _List, merge_prepared

    rng = np.random.default_rng(0)
    lists = []
    for base in (1 << 20, 1 << 30):
        b = np.arange(REGIONS * NB, dtype=np.uint64)
        rows = np.stack([base + b * PAGE, np.full_like(b, PAGE), np.zeros_like(b)], axis=1)
        lists.append(_List(rows, "DRAM", "x", _continues(rows)))
    for _ in range(50):
        n = int(rng.integers(1, NB))
        local = np.sort(rng.choice(np.arange(1, NB), n, replace=False))
        remote = np.arange(1, n + 1) if rng.random() < 0.5 else local[rng.permutation(n)]
        lidx, ridx = _ids(local.tolist()), _ids(remote.tolist())
        got = merge_prepared(lists[0], lidx, lists[1], ridx)
        want = merge_descs(lists[0].rows[lidx], lists[1].rows[ridx])
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_install_refuses_non_bool_settings() -> None:
    with pytest.raises(ValueError, match="kvstage_merge_reads"):
        install_merged_reads(object(), {"kvstage_merge_reads": "no"}, None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def api() -> Any:
    from kvstage.transport.nixl import _import_nixl, default_ucx_env

    try:
        return _import_nixl(default_ucx_env())
    except ImportError:
        pytest.skip("needs NIXL: `make test-vllm` installs nixl + nixl-cu12")


class Side:
    """One agent with a registered host buffer [REGIONS, NB, PAGE] and vLLM's rows."""

    def __init__(self, api: Any, name: str) -> None:
        config = api.nixl_agent_config(backends=["UCX"], capture_telemetry=True)
        self.agent = api.nixl_agent(name, config)
        self.name = name
        self.buf = torch.randint(0, 256, (REGIONS, NB, PAGE), dtype=torch.uint8)
        addr = self.buf.data_ptr()
        self.reg = self.agent.get_reg_descs([(addr, self.buf.nbytes, 0, "")], "DRAM")
        self.agent.register_memory(self.reg)
        blocks = np.arange(REGIONS * NB, dtype=np.uint64)
        self.rows = np.stack([addr + blocks * PAGE, np.full_like(blocks, PAGE),
                              np.zeros_like(blocks)], axis=1)


@pytest.fixture()
def pair(api: Any) -> Iterator[tuple[Side, Side]]:
    stamp = f"{time.monotonic_ns()}"
    prefill, decode = Side(api, f"p-{stamp}"), Side(api, f"d-{stamp}")
    decode.agent.add_remote_agent(prefill.agent.get_agent_metadata())
    yield prefill, decode
    decode.agent.remove_remote_agent(prefill.name)
    for side in (decode, prefill):
        side.agent.deregister_memory(side.reg)


def _ids(blocks: list[int]) -> np.ndarray:
    """vLLM's _compute_desc_ids for regions shared by every group: region-major."""
    b = np.asarray(blocks, dtype=np.int64)
    return (np.arange(REGIONS, dtype=np.int64)[:, None] * NB + b[None, :]).ravel()


def _read(decode: Side, prefill: Side, merge: bool, local: list[int], remote: list[int],
          notif: bytes) -> MergedReads:
    reads = MergedReads(decode.agent, merge=merge).install()
    ag = decode.agent
    lh = ag.prep_xfer_dlist("NIXL_INIT_AGENT", ag.get_xfer_descs(decode.rows, "DRAM"))
    rh = ag.prep_xfer_dlist(prefill.name, ag.get_xfer_descs(prefill.rows, "DRAM"))
    handle = ag.make_prepped_xfer("READ", lh, _ids(local), rh, _ids(remote), notif_msg=notif)
    assert ag.transfer(handle) in ("DONE", "PROC")
    deadline = time.monotonic() + 20
    while (state := ag.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "READ did not finish in 20 s"
        time.sleep(0.001)
    assert state == "DONE"
    ag.get_xfer_telemetry(handle)
    ag.release_xfer_handle(handle)
    for h in (lh, rh):
        ag.release_dlist_handle(h)
    return reads


def _notifs(prefill: Side, want: bytes) -> list[bytes]:
    deadline = time.monotonic() + 20
    got: list[bytes] = []
    while want not in got and time.monotonic() < deadline:
        for msgs in prefill.agent.get_new_notifs().values():
            got += msgs
        time.sleep(0.001)
    return got


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-block"])
@pytest.mark.parametrize(
    ("local", "remote"),
    [
        (list(range(1, 11)), list(range(5, 15))),  # a fresh pool: one run
        ([9, 8, 7, 20, 21, 22, 23, 2, 3, 30], list(range(1, 11))),  # fragmented local ids
        ([4, 5, 6, 7], [10, 11, 30, 31]),  # a remote gap splits a local run
    ],
    ids=["one-run", "fragmented", "remote-gap"],
)
def test_read_bytes_notification_and_descriptor_count(
    pair: tuple[Side, Side], merge: bool, local: list[int], remote: list[int]
) -> None:
    prefill, decode = pair
    before = decode.buf.clone()
    notif = f"req-{merge}-{local[0]}:1".encode()
    reads = _read(decode, prefill, merge, local, remote, notif)
    for lb, rb in zip(local, remote, strict=True):
        assert torch.equal(decode.buf[:, lb], prefill.buf[:, rb])
    untouched = sorted(set(range(NB)) - set(local))
    assert torch.equal(decode.buf[:, untouched], before[:, untouched])
    assert notif in _notifs(prefill, notif)

    (rec,) = reads.records
    runs = find_runs(np.array(remote), np.array(local)).shape[0]
    assert rec.per_block == REGIONS * len(local)
    assert rec.descriptors == (REGIONS * runs if merge else REGIONS * len(local))
    assert rec.merged == merge
    assert rec.nbytes == REGIONS * len(local) * PAGE
    print(f"{'merged' if merge else 'per-block'}: handed {rec.descriptors}, NIXL telemetry "
          f"descCount {rec.nixl_descs}")
