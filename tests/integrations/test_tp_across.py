"""Prefill and decode at different TP sizes, below the network: vLLM-shaped rank caches of one
global hybrid model (an attention group and a Mamba2 group aliasing one int8 buffer, as
vLLM 0.32.0 hands them), cut by `integrations.vllm.tp`, copied by `pd.tp_copy`, each READ
played as the copy of one part's rows (what NIXL moves: `HostPart.descriptors`).

Asserted exactly, for P -> D in (1 -> 2, 2 -> 1):
- every decode rank's pages of the request's blocks hold exactly its shard of the global
  heads, conv rows (x, B, C) and SSM heads, at its local ids; every other byte of its pool
  is untouched (padding included);
- copy ops: the d2h is one ``copy_`` per run, part and segment (attention 1 segment per
  part, Mamba2 DS 4 per slice, 1 for a whole page), the h2d the same per region; READ
  descriptors: one per run per read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage.cache import HostBuffer
from kvstage.engine import Direction
from kvstage.errors import LayoutMismatch
from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.integrations.vllm.tp import decode_side, prefill_side
from kvstage.pd.reads import pair_runs
from kvstage.pd.tp_copy import HostPart, PartCopy
from tests.integrations.test_vllm_state import FullAttentionSpec, MambaSpec

NB = 8
H, N, C = 2, 8, 16  # KV heads, tokens per block, 2 x head size (fp32)
HS, P, G, NS, W = 2, 4, 2, 4, 3  # SSM heads, head dim, groups, state size, conv width
I_ = HS * P
CONV_ROWS = I_ + 2 * G * NS


def global_model(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(NB, H, N, C, generator=g), torch.randn(NB, CONV_ROWS, W, generator=g),
            torch.randn(NB, HS, P, NS, generator=g))


def conv_rows(tp: int, rank: int) -> list[int]:
    """Global conv rows rank ``rank`` holds at ``tp``: its x, B and C rows, in order."""
    x, gn = I_ // tp, G * NS // tp
    return ([*range(rank * x, (rank + 1) * x)]
            + [I_ + r for r in range(rank * gn, (rank + 1) * gn)]
            + [I_ + G * NS + r for r in range(rank * gn, (rank + 1) * gn)])


def rank_caches(tp: int, rank: int, attn: torch.Tensor | None, conv: torch.Tensor | None,
                ssm: torch.Tensor | None, ids: list[list[int]], seed: int,
                device: str = "cpu") -> tuple[dict[str, torch.Tensor], list, torch.Tensor]:
    """One rank's vLLM-like caches (random bytes), the request's blocks filled with its
    shard of the global model at ``ids`` (group 0 Mamba, group 1 attention)."""
    h = H // tp
    page = h * N * C * 4
    buf = torch.randint(-128, 127, (NB * page,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(seed)).to(device)
    if device != "cpu":
        attn, conv, ssm = (None if t is None else t.to(device) for t in (attn, conv, ssm))
    attn_v = buf.view(torch.float32).as_strided((NB, h, N, C), (page // 4, N * C, C, 1))
    rows, heads = CONV_ROWS // tp, HS // tp
    conv_v = buf.view(torch.float32).as_strided((NB, rows, W), (page // 4, W, 1))
    ssm_v = buf.view(torch.float32).as_strided((NB, heads, P, NS),
                                               (page // 4, P * NS, NS, 1), rows * W)
    state = rows * W * 4 + heads * P * NS * 4
    mamba = buf.as_strided((NB, 1, 1, state), (page, state, state, 1))
    if attn is not None:
        for b in ids[1]:
            attn_v[b] = attn[b, rank * h:(rank + 1) * h]
    if conv is not None and ssm is not None:
        for b in ids[0]:
            conv_v[b] = conv[b, conv_rows(tp, rank)]
            ssm_v[b] = ssm[b, rank * heads:(rank + 1) * heads]
    groups = [(["mamba.0"], MambaSpec(block_size=4096, shapes=((rows, W), (heads, P, NS)))),
              (["attn.0"], FullAttentionSpec(block_size=N, num_kv_heads=h, head_size=C // 2))]
    return {"mamba.0": mamba, "attn.0": attn_v}, groups, buf


REMOTE = [[5], [1, 2, 3]]
LOCAL = [[7], [2, 3, 4]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_every_decode_rank_gets_its_shard_and_nothing_else(prefill_tp: int, decode_tp: int,
                                                           device: str) -> None:
    """On CUDA (``gpu``): the same bytes through pinned host buffers and non-blocking
    copies on the current stream."""
    attn, conv, ssm = global_model(1)
    hosts = []
    for p in range(prefill_tp):
        caches, groups, _ = rank_caches(prefill_tp, p, attn, conv, ssm, REMOTE, seed=10 + p,
                                        device=device)
        cache = wrap_vllm_caches(caches, groups, NB, "tiny")
        side, readers = prefill_side(caches, groups, cache.layout, tp_size=prefill_tp,
                                     rank=p, peer_tp=decode_tp, total_kv_heads=H)
        assert readers == max(1, decode_tp // prefill_tp)
        host = HostBuffer.for_device(cache.layout, cache.device)
        assert host.pinned == (device == "cuda")
        engine = PartCopy(cache, host, side.parts)
        plan = engine.plan(REMOTE)
        engine.run(plan, Direction.D2H)
        segs = [len(g.segments[0]) for g in side.parts.groups]
        # a slice: x, B, C, SSM heads; one head-major range (a whole page: one range)
        assert segs == ([4, 1] if side.parts.num_parts > 1 else [1, 1])
        # per part and segment, per run of a group (Mamba [5], attention [1, 2, 3])
        assert engine.ops(plan, Direction.D2H) == side.parts.num_parts * sum(segs)
        hosts.append((host, side))
    for d in range(decode_tp):
        caches, groups, buf = rank_caches(decode_tp, d, None, None, None, LOCAL, seed=50 + d,
                                          device=device)
        before = buf.clone()
        cache = wrap_vllm_caches(caches, groups, NB, "tiny")
        side, reads, num_slices = decode_side(caches, groups, cache.layout, tp_size=decode_tp,
                                              rank=d, peer_tp=prefill_tp, total_kv_heads=H)
        assert num_slices == max(1, decode_tp // prefill_tp)
        whole = HostBuffer.for_device(cache.layout, cache.device)
        for r in reads:
            theirs_host, theirs = hosts[r.prefill_rank]
            src = HostPart(theirs_host, theirs.parts, r.slice_index)
            dst = HostPart(whole, side.parts, r.region_index)
            assert theirs.parts.signature() == side.parts.signature()
            runs = pair_runs(REMOTE, LOCAL)
            # the READ: one descriptor per run on each side, rows of the same bytes
            s_desc, d_desc = src.descriptors(runs[:, 0], runs[:, 2]), dst.descriptors(
                runs[:, 1], runs[:, 2])
            assert s_desc.shape[0] == d_desc.shape[0] == runs.shape[0]
            assert (s_desc[:, 1] == d_desc[:, 1]).all()
            for a, b, n in runs.tolist():
                dst.storage[b:b + n] = src.storage[a:a + n]
            engine = PartCopy(cache, whole, side.parts, region=r.region_index)
            engine.assign(LOCAL)
            engine.copy_runs(np.stack((runs[:, 1], runs[:, 1], runs[:, 2]), axis=1),
                             Direction.H2D)
        want_caches, _, want = rank_caches(decode_tp, d, attn, conv, ssm, LOCAL, seed=50 + d)
        buf, before = buf.cpu(), before.cpu()
        # place the global shard at the local ids: LOCAL[g][i] holds REMOTE[g][i]'s data
        for g, name in ((1, "attn.0"),):
            for rb, lb in zip(REMOTE[g], LOCAL[g], strict=True):
                want_caches[name][lb] = attn[rb, d * (H // decode_tp):(d + 1) * (H // decode_tp)]
        rows, heads = CONV_ROWS // decode_tp, HS // decode_tp
        page = H // decode_tp * N * C * 4
        conv_v = want.view(torch.float32).as_strided((NB, rows, W), (page // 4, W, 1))
        ssm_v = want.view(torch.float32).as_strided(
            (NB, heads, P, NS), (page // 4, P * NS, NS, 1), rows * W)
        for rb, lb in zip(REMOTE[0], LOCAL[0], strict=True):
            conv_v[lb] = conv[rb, conv_rows(decode_tp, d)]
            ssm_v[lb] = ssm[rb, d * heads:(d + 1) * heads]
        # bytes the request does not own are the decode's own, untouched
        touched = torch.zeros(NB, dtype=torch.bool)
        touched[[b for g in LOCAL for b in g]] = True
        pages = buf.view(NB, -1)
        assert torch.equal(pages[~touched], before.view(NB, -1)[~touched])
        state = rows * W * 4 + heads * P * NS * 4
        for b in LOCAL[0]:  # the state's bytes; the padding after it is not the model's
            assert torch.equal(pages[b, :state], want.view(NB, -1)[b, :state]), (d, b)
        for b in LOCAL[1]:
            assert torch.equal(pages[b], want.view(NB, -1)[b]), (d, b)


def test_a_field_that_does_not_split_is_refused_in_one_line() -> None:
    """3 KV heads at TP 1 -> decode TP 2: vLLM cannot run it, kvstage says so at start."""
    caches, groups, _ = rank_caches(1, 0, None, None, None, REMOTE, seed=1)
    cache = wrap_vllm_caches(caches, groups, NB, "tiny")
    with pytest.raises(LayoutMismatch) as err:
        prefill_side(caches, groups, cache.layout, tp_size=1, rank=0, peer_tp=3,
                     total_kv_heads=H)
    assert "\n" not in str(err.value) and "TP 3" in str(err.value)
