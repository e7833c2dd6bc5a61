"""Hypothesis fuzz: layouts x block ids x strategies x directions, byte-exact against a
naive per-block reference.

Layouts: `synthetic_layout` with random shape/dtype and every preset with a small pool,
both cache layouts (MLA: packed only) and both host layouts. Ids: one shared pool split
over the groups (so non-null ids are unique across groups), empty groups, null ids
anywhere, scattered or contiguous. Strategies: per_group, coalesced, fused direct and
fused staged with tiny staging budgets (down to one block per chunk).

Examples: the hypothesis profile the conftest loads (``KVSTAGE_HYPOTHESIS_PROFILE``),
overridden by ``KVSTAGE_FUZZ_EXAMPLES=N``; 60 when neither exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import kvstage as ks
from kvstage.plan import INDEX_BYTES, find_runs, split_runs
from kvstage.presets import STATE_PRESETS, cache_layouts_for, synthetic_hybrid_layout
from kvstage.testing.baselines import make_engine


def _fuzz_settings() -> settings:
    common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow,
                                                          HealthCheck.data_too_large]}
    env = os.environ.get("KVSTAGE_FUZZ_EXAMPLES")
    if env:
        return settings(max_examples=int(env), **common)  # type: ignore[arg-type]
    try:
        settings.get_profile("ci")  # the conftest registered profiles: use the loaded one
    except InvalidArgument:
        return settings(max_examples=60, **common)  # type: ignore[arg-type]
    return settings(**common)  # type: ignore[arg-type]


FUZZ = _fuzz_settings()
DTYPES = ["float16", "bfloat16", "float32", "uint8", "int8", "float8_e4m3fn"]


@st.composite
def layouts(draw: st.DrawFn) -> ks.KVLayout:
    if draw(st.booleans()):
        num_layers = draw(st.integers(1, 7))
        return ks.synthetic_layout(
            num_layers=num_layers,
            num_groups=draw(st.integers(1, num_layers)),
            num_blocks=draw(st.integers(2, 40)),
            block_size=draw(st.sampled_from([1, 2, 3, 4])),
            num_kv_heads=draw(st.integers(1, 3)),
            head_size=draw(st.sampled_from([1, 2, 4, 8])),
            dtype=draw(st.sampled_from(DTYPES)),
            cache_layout=draw(st.sampled_from(list(ks.CacheLayout))),
        )
    if draw(st.booleans()):  # Mamba2 + attention, bf16 pages beside fp32 state (bytes)
        return synthetic_hybrid_layout(
            num_attention=draw(st.integers(1, 3)), num_state=draw(st.integers(1, 9)),
            num_blocks=draw(st.integers(2, 40)), alignment=draw(st.sampled_from([1, 2, 4])),
        )
    name = draw(st.sampled_from([n for n in sorted(ks.PRESETS) if n not in STATE_PRESETS]))
    cache = draw(st.sampled_from(cache_layouts_for(name)))
    return ks.preset(name, num_blocks=draw(st.integers(2, 16)),
                     block_size=draw(st.sampled_from([1, 2])), cache_layout=cache)


@st.composite
def grouped_ids(draw: st.DrawFn, layout: ks.KVLayout) -> list[list[int]]:
    """Distinct non-null ids split over the groups, nulls sprinkled in, groups may be
    empty; sometimes one contiguous range (a single run), usually scattered."""
    nb = layout.num_blocks
    kind = draw(st.sampled_from(["mask", "sparse", "range"]))
    if kind == "mask":  # each block in or out: dense, many runs of every length
        mask = draw(st.lists(st.booleans(), min_size=nb - 1, max_size=nb - 1))
        real = [b for b, keep in zip(range(1, nb), mask, strict=True) if keep]
    elif kind == "sparse":
        real = draw(st.lists(st.integers(1, nb - 1), unique=True, max_size=nb - 1))
    else:  # one contiguous range: a single run
        lo = draw(st.integers(1, nb - 1))
        real = list(range(lo, draw(st.integers(lo, nb))))
    if draw(st.booleans()):
        real = list(draw(st.permutations(real)))  # groups get ids in any order
    cuts = sorted(draw(st.lists(st.integers(0, len(real)), min_size=layout.num_groups - 1,
                                max_size=layout.num_groups - 1)))
    bounds = [0, *cuts, len(real)]
    groups = []
    for g in range(layout.num_groups):
        ids = real[bounds[g]:bounds[g + 1]]
        for _ in range(draw(st.integers(0, 2))):  # null padding (sliding-window style)
            ids.insert(draw(st.integers(0, len(ids))), 0)
        groups.append(ids)
    return groups


@dataclass(frozen=True)
class How:
    strategy: ks.Strategy
    mode: str = "auto"
    budget_blocks: int | None = None  # fused staged: blocks per chunk budget

    def engine(self, cache: ks.KVCache, host: ks.HostBuffer) -> ks.CopyEngine:
        if self.strategy is not ks.Strategy.FUSED:
            return make_engine(cache, host, self.strategy)
        budget = ks.plan.DEFAULT_MAX_TEMP_BYTES
        if self.budget_blocks is not None:  # 0: below one block (chunks still hold 1)
            budget = max(1, self.budget_blocks * (cache.layout.block_bytes + INDEX_BYTES))
        return ks.CopyEngine(cache, host, max_temp_bytes=budget,
                             mode=self.mode)  # type: ignore[arg-type]


HOWS = st.one_of(
    st.sampled_from([How(ks.Strategy.PER_GROUP), How(ks.Strategy.COALESCED),
                     How(ks.Strategy.FUSED, "direct"), How(ks.Strategy.FUSED, "staged")]),
    st.builds(How, st.just(ks.Strategy.FUSED), st.just("staged"), st.integers(0, 4)),
)


def random_bytes(t: torch.Tensor, seed: int) -> None:
    """Random but finite values (same trick as KVCache.fill_random)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8,
                        generator=gen)
    if t.dtype.is_floating_point:
        raw.view(-1, t.element_size())[:, -1] &= 0x3F
    t.view(-1).view(torch.uint8).copy_(raw)


def as_bytes(canonical: torch.Tensor) -> torch.Tensor:
    """[T, P, NB, E] (any strides) -> [T, P, NB, E * itemsize] uint8 copy."""
    return canonical.contiguous().view(torch.uint8).clone()


def reference(src: torch.Tensor, dst: torch.Tensor, groups: list[list[int]],
              strategy: ks.Strategy) -> torch.Tensor:
    """Naive: for every non-null id, block b of every tensor and plane is copied. vLLM's
    strategies also copy the null block 0 when it is listed (harmless waste)."""
    out = dst.clone()
    flat = [b for g in groups for b in g]
    for b in sorted({b for b in flat if b}):
        out[:, :, b] = src[:, :, b]
    if strategy is not ks.Strategy.FUSED and 0 in flat:
        out[:, :, 0] = src[:, :, 0]
    return out


@FUZZ
@given(data=st.data())
def test_copy_matches_naive_reference(data: st.DataObject) -> None:
    layout = data.draw(layouts(), label="layout")
    host_layout = data.draw(st.sampled_from(list(ks.HostLayout)), label="host_layout")
    groups = data.draw(grouped_ids(layout), label="ids")
    how = data.draw(HOWS, label="how")
    direction = data.draw(st.sampled_from(list(ks.Direction)), label="direction")
    seed = data.draw(st.integers(0, 2**16), label="seed")

    cache = ks.KVCache(layout)
    host = ks.HostBuffer(layout, host_layout)
    random_bytes(cache.slab, seed)
    random_bytes(host.storage, seed + 1)
    src, dst = ((cache.canonical, host.canonical) if direction is ks.Direction.D2H
                else (host.canonical, cache.canonical))
    src_before = as_bytes(src)
    want = reference(as_bytes(src), as_bytes(dst), groups, how.strategy)

    stats = how.engine(cache, host).copy(groups, direction)

    assert torch.equal(as_bytes(src), src_before), "source changed"
    got = as_bytes(dst)
    if not torch.equal(got, want):
        bad = (got != want).flatten(start_dim=3).any(dim=3).any(dim=0).any(dim=0)
        pytest.fail(f"blocks {torch.nonzero(bad).flatten().tolist()} differ from the "
                    f"reference ({how}, {direction}, {host_layout}, {layout.name})")
    real = {b for g in groups for b in g if b}
    if how.strategy is ks.Strategy.FUSED:
        assert stats.blocks == len(real)
        assert stats.nbytes == len(real) * layout.block_bytes


@FUZZ
@given(
    ids=st.lists(st.integers(0, 200), unique=True, max_size=60),
    shift=st.integers(-3, 3),
    max_len=st.integers(1, 9),
)
def test_runs_and_chunks_cover_every_pair_once(ids: list[int], shift: int, max_len: int) -> None:
    """find_runs + split_runs: the pieces, in order, are exactly the (src, dst) pairs
    sorted by dst, and no chunk holds more than ``max_len`` blocks."""
    src = np.array(ids, dtype=np.int64)
    dst = np.random.default_rng(len(ids)).permutation(src) + shift + 3
    runs = find_runs(src, dst)
    pieces, chunks = split_runs(runs, max_len)
    order = np.argsort(dst, kind="stable")
    want = list(zip(src[order].tolist(), dst[order].tolist(), strict=True))
    got = [(s + k, d + k) for s, d, n, _ in pieces.tolist() for k in range(n)]
    assert got == want
    assert len(runs) == 0 or (runs[:, 2] >= 1).all()
    for first, end in chunks.tolist():
        assert int(pieces[first:end, 2].sum()) <= max_len
        offs = pieces[first:end, 3].tolist()
        assert offs == sorted(offs) and (not offs or offs[0] == 0)
