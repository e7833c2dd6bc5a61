"""pd/'s roles across TP sizes, in one process over the loopback transport: the handshake,
the READ of a slice, the checksums of a slice, the readers a prefill waits for.

The ranks' caches are `tests.integrations.test_tp_across`'s vLLM-shaped hybrid (a Mamba2
group and an attention group aliasing one buffer) holding their shards of one global model.
Asserted exactly:
- P TP1 -> D TP2 (checksums on): each decode rank READs its slice (one descriptor per run)
  into its pages, which then hold exactly its shard; the prefill holds the request until
  BOTH decode ranks have notified (held after the first, freed after the second);
- P TP2 -> D TP1: the decode rank's two regions (one DecodeWorker each, one shared host
  buffer) read the two prefill ranks; its pages hold the whole model;
- a decode not cut for the prefill's slices is refused at handshake in one line naming the
  prefill's TP and the setting, and nothing is read.
"""

from __future__ import annotations

import torch

from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.integrations.vllm.tp import decode_side, prefill_side
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.prefill import PrefillWorker
from kvstage.pd.side_channel import SideChannelClient
from kvstage.pd.tp_copy import host_for
from kvstage.testing.servers import PrefillThread
from kvstage.transport import LoopbackTransport
from tests.helpers import wait_for
from tests.integrations.test_tp_across import LOCAL, NB, REMOTE, H, global_model, rank_caches


def _prefills(tp: int, peer: int, model: tuple[torch.Tensor, ...], rid: str
              ) -> list[tuple[PrefillWorker, bytes]]:
    out = []
    for p in range(tp):
        caches, groups, _ = rank_caches(tp, p, *model, REMOTE, seed=10 + p)
        cache = wrap_vllm_caches(caches, groups, NB, "tiny")
        side, readers = prefill_side(caches, groups, cache.layout, tp_size=tp, rank=p,
                                     peer_tp=peer, total_kv_heads=H)
        worker = PrefillWorker(cache, LoopbackTransport(f"p{p}"), tp=side, readers=readers,
                               verify_checksum=True, engine_id=f"p/{p}")
        worker.save(rid, REMOTE)
        out.append((worker, worker.hold(rid).capability))
    return out


def _decode(tp: int, d: int, peer: int, *, cut: bool = True
            ) -> tuple[list[tuple[DecodeWorker, int]], torch.Tensor, list]:
    caches, groups, buf = rank_caches(tp, d, None, None, None, LOCAL, seed=50 + d)
    cache = wrap_vllm_caches(caches, groups, NB, "tiny")
    if not cut:
        return [(DecodeWorker(cache, LoopbackTransport(f"d{d}"), verify_checksum=True,
                              handshake_timeout_s=2.0, read_timeout_s=5.0), d)], buf, groups
    side, reads, slices = decode_side(caches, groups, cache.layout, tp_size=tp, rank=d,
                                      peer_tp=peer, total_kv_heads=H)
    whole = host_for(cache)
    return [(DecodeWorker(cache, LoopbackTransport(f"d{d}.{r.region_index}"),
                          verify_checksum=True, handshake_timeout_s=2.0, read_timeout_s=5.0,
                          tp=side, region=r.region_index, slice_index=r.slice_index,
                          num_slices=slices, host_buffer=whole), r.prefill_rank)
             for r in reads], buf, groups


def _want(tp: int, d: int, model: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Decode rank d's pool bytes once the request landed: LOCAL holds REMOTE's shard."""
    attn, conv, ssm = (t.clone() for t in model)
    for rb, lb in zip(REMOTE[1], LOCAL[1], strict=True):
        attn[lb] = model[0][rb]
    for rb, lb in zip(REMOTE[0], LOCAL[0], strict=True):
        conv[lb], ssm[lb] = model[1][rb], model[2][rb]
    return rank_caches(tp, d, attn, conv, ssm, LOCAL, seed=50 + d)[2]


def _state_and_attention_equal(got: torch.Tensor, want: torch.Tensor, tp: int) -> None:
    pages_got, pages_want = got.view(NB, -1), want.view(NB, -1)
    for b in LOCAL[1]:
        assert torch.equal(pages_got[b], pages_want[b]), b
    heads, rows = 2 // tp, (8 + 16) // tp
    state = rows * 3 * 4 + heads * 4 * 4 * 4
    for b in LOCAL[0]:
        assert torch.equal(pages_got[b, :state], pages_want[b, :state]), b


def test_one_prefill_rank_read_by_two_decode_ranks_frees_after_both() -> None:
    model = global_model(3)
    (prefill, cap), = _prefills(1, 2, model, "r")
    with PrefillThread(prefill) as served:
        host, port = served.address
        for d in range(2):
            roles, buf, _ = _decode(2, d, 1)
            (role, p), = roles
            assert p == 0 and role.slice_index == d and role.num_slices == 2
            result = role.start("r", (host, port), REMOTE, LOCAL, capability=cap)
            result = role.wait("r", 10.0) if result.status == "pending" else result
            assert result.status == "done", result.reason
            # one descriptor per run (Mamba [5] -> [7], attention [1, 2, 3] -> [2, 3, 4])
            assert result.num_descriptors == 2
            stats = role.client(host, port).call(m.GetStats())
            assert isinstance(stats, m.Stats)
            if d == 0:  # read by one of its two readers: still held
                assert (stats.held_requests, stats.completed) == (1, 0)
            _state_and_attention_equal(buf, _want(2, d, model), 2)
            role.close()

        def completed() -> bool:
            stats = SideChannelClient(host, port, timeout_s=2.0).call(m.GetStats())
            return isinstance(stats, m.Stats) and (stats.held_requests, stats.completed) == (
                0, 1)

        wait_for(completed)


def test_two_prefill_ranks_fill_one_decode_rank() -> None:
    model = global_model(4)
    prefills = _prefills(2, 1, model, "r")
    threads = [PrefillThread(w) for w, _ in prefills]
    try:
        roles, buf, _ = _decode(1, 0, 2)
        assert [p for _, p in roles] == [0, 1]
        for role, p in roles:
            result = role.start("r", threads[p].address, REMOTE, LOCAL,
                                capability=prefills[p][1])
            result = role.wait("r", 10.0) if result.status == "pending" else result
            assert result.status == "done", result.reason
        _state_and_attention_equal(buf, _want(1, 0, model), 1)
        for role, _ in roles:
            role.close()
    finally:
        for t in threads:
            t.stop()


def test_a_decode_not_cut_for_the_slices_is_refused_at_handshake() -> None:
    model = global_model(5)
    (prefill, cap), = _prefills(1, 2, model, "r")
    with PrefillThread(prefill) as served:
        (role, _), = _decode(1, 0, 1, cut=False)[0]
        before = role.transport.num_open_handles
        result = role.start("r", served.address, REMOTE, LOCAL, capability=cap)
        assert result.status == "failed"
        assert "\n" not in result.reason
        assert ("(TP 1 rank 0) cut its host buffer for decode TP 2 but this decode reads "
                "whole pages") in result.reason
        assert "kvstage_peer_tp_size=1" in result.reason
        assert role.transport.num_open_handles == before  # nothing was read
        role.close()


def test_a_replica_no_decode_rank_reads_is_not_copied_and_freed_at_hold() -> None:
    """1 KV head at prefill TP 2 -> decode TP 1 (the mapping reads rank 0's copy): rank 1
    copies nothing and lets the request go as it is held."""
    from kvstage.pd.tp_map import AttentionShards, plan_tp, readers_per_prefill_rank

    plan = plan_tp(2, 1, [AttentionShards(num_kv_heads=1)])
    assert readers_per_prefill_rank(plan) == {0: 1, 1: 0}
    caches, groups, _ = rank_caches(1, 0, *global_model(6), REMOTE, seed=3)
    cache = wrap_vllm_caches(caches, groups, NB, "tiny")
    side, _ = prefill_side(caches, groups, cache.layout, tp_size=1, rank=0, peer_tp=1,
                           total_kv_heads=H)
    freed: list[str] = []
    worker = PrefillWorker(cache, LoopbackTransport("p1"), tp=side, readers=0,
                           on_free=lambda rid, ids: freed.append(rid))
    before = worker.host.storage.clone()
    stats = worker.save("r", REMOTE)
    assert (stats.blocks, stats.nbytes, stats.ops) == (0, 0, 0)
    worker.hold("r")
    assert freed == ["r"] and worker.num_held == 0 and worker.counters.completed == 1
    assert torch.equal(worker.host.storage, before)
    worker.close()
