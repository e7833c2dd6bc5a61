"""`kvstage.pd.tp_map`: the exact reads of every decode rank over the TP grid {1,2,4}^2, for
attention (split and replicated heads), MLA, two-group, Mamba2 and GDN hybrids; a
brute-force unit check against an independent copy of vLLM's sharding rule; and the
one-line refusals."""

from __future__ import annotations

import dataclasses
from itertools import product

import pytest

from kvstage.errors import LayoutMismatch
from kvstage.pd.tp_map import (
    AttentionShards,
    Read,
    ReplicatedShards,
    Shards,
    StateShards,
    TPPlan,
    describe,
    descriptors_per_run,
    plan_tp,
    readers_per_prefill_rank,
    refuse_across_sizes,
)


def mamba2(x: int, groups: int, heads: int) -> StateShards:
    return StateShards(fields=(("x", x), ("B", groups), ("C", groups), ("ssm_heads", heads)))


MODELS: dict[str, list[Shards]] = {
    "llama-h8": [AttentionShards(num_kv_heads=8)],
    "llama-h2": [AttentionShards(num_kv_heads=2)],
    "h1": [AttentionShards(num_kv_heads=1)],
    "mla": [ReplicatedShards()],
    "gemma3": [AttentionShards(num_kv_heads=2), AttentionShards(num_kv_heads=2)],
    "mamba2-hybrid": [AttentionShards(num_kv_heads=2), mamba2(128, 2, 4)],
    "gdn": [
        StateShards(fields=(("q", 2), ("k", 2), ("v", 4), ("state_heads", 4))),
        AttentionShards(num_kv_heads=2),
    ],
    # replicated at TP 4 beside a group that still splits there
    "mixed": [AttentionShards(num_kv_heads=2), mamba2(128, 4, 8)],
}

Cell = tuple[int, int]
# (S, R, reads per decode rank as (prefill_rank, slice_index, region_index), readers)
Expected = tuple[int, int, tuple[tuple[tuple[int, int, int], ...], ...], dict[int, int]]

ONE = {0: 1}
TWO = {0: 1, 1: 1}
FOUR = {0: 1, 1: 1, 2: 1, 3: 1}
EVEN = {0: 1, 1: 0, 2: 1, 3: 0}

SPLIT: dict[Cell, Expected] = {
    (1, 1): (1, 1, (((0, 0, 0),),), ONE),
    (1, 2): (2, 1, (((0, 0, 0),), ((0, 1, 0),)), {0: 2}),
    (1, 4): (4, 1, (((0, 0, 0),), ((0, 1, 0),), ((0, 2, 0),), ((0, 3, 0),)), {0: 4}),
    (2, 1): (1, 2, (((0, 0, 0), (1, 0, 1)),), TWO),
    (2, 2): (1, 1, (((0, 0, 0),), ((1, 0, 0),)), TWO),
    (2, 4): (2, 1, (((0, 0, 0),), ((0, 1, 0),), ((1, 0, 0),), ((1, 1, 0),)), {0: 2, 1: 2}),
    (4, 1): (1, 4, (((0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3)),), FOUR),
    (4, 2): (1, 2, (((0, 0, 0), (1, 0, 1)), ((2, 0, 0), (3, 0, 1))), FOUR),
    (4, 4): (1, 1, (((0, 0, 0),), ((1, 0, 0),), ((2, 0, 0),), ((3, 0, 0),)), FOUR),
}
# H=2: replicated at TP 4 (ranks 0,1 hold head 0; 2,3 head 1)
HEADS2: dict[Cell, Expected] = {
    **SPLIT,
    (1, 4): (2, 1, (((0, 0, 0),), ((0, 0, 0),), ((0, 1, 0),), ((0, 1, 0),)), {0: 4}),
    (2, 4): (1, 1, (((0, 0, 0),), ((0, 0, 0),), ((1, 0, 0),), ((1, 0, 0),)), {0: 2, 1: 2}),
    (4, 1): (1, 2, (((0, 0, 0), (2, 0, 1)),), EVEN),
    (4, 2): (1, 1, (((0, 0, 0),), ((2, 0, 0),)), EVEN),
}
# every rank holds the whole page: one read of one whole prefill page
WHOLE: dict[Cell, Expected] = {
    (1, 1): (1, 1, (((0, 0, 0),),), ONE),
    (1, 2): (1, 1, (((0, 0, 0),), ((0, 0, 0),)), {0: 2}),
    (1, 4): (1, 1, (((0, 0, 0),),) * 4, {0: 4}),
    (2, 1): (1, 1, (((0, 0, 0),),), {0: 1, 1: 0}),
    (2, 2): (1, 1, (((0, 0, 0),), ((1, 0, 0),)), TWO),
    (2, 4): (1, 1, (((0, 0, 0),), ((0, 0, 0),), ((1, 0, 0),), ((1, 0, 0),)), {0: 2, 1: 2}),
    (4, 1): (1, 1, (((0, 0, 0),),), {0: 1, 1: 0, 2: 0, 3: 0}),
    (4, 2): (1, 1, (((0, 0, 0),), ((2, 0, 0),)), EVEN),
    (4, 4): (1, 1, (((0, 0, 0),), ((1, 0, 0),), ((2, 0, 0),), ((3, 0, 0),)), FOUR),
}
NO_TP4 = {cell: SPLIT[cell] for cell in ((1, 1), (1, 2), (2, 1), (2, 2))}

EXPECTED: dict[str, dict[Cell, Expected]] = {
    "llama-h8": SPLIT,
    "llama-h2": HEADS2,
    "h1": WHOLE,
    "mla": WHOLE,
    "gemma3": HEADS2,
    "mamba2-hybrid": NO_TP4,  # B=C=2 do not split over TP 4
    "gdn": NO_TP4,  # q=k=2 do not split over TP 4
    "mixed": {**NO_TP4, (4, 4): SPLIT[(4, 4)]},  # groups shard differently elsewhere
}
GRID = [(name, p, d) for name in MODELS for p, d in product((1, 2, 4), repeat=2)]
SUPPORTED = [(name, p, d) for name, p, d in GRID if (p, d) in EXPECTED[name]]


def ref_units(shard: Shards, tp: int, rank: int) -> list[list[int]]:
    """Global units per field, written out from vLLM's rule independently of the module."""
    if isinstance(shard, AttentionShards):
        heads = shard.num_kv_heads
        if heads >= tp:
            return [list(range(rank * heads // tp, (rank + 1) * heads // tp))]
        return [[rank // (tp // heads)]]
    if isinstance(shard, ReplicatedShards):
        return [[0]]
    return [list(range(rank * u // tp, (rank + 1) * u // tp)) for _, u in shard.fields]


def as_tuples(plan: TPPlan) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    return tuple(
        tuple(dataclasses.astuple(r) for r in plan.reads(d)) for d in range(plan.decode_tp)
    )


@pytest.mark.parametrize(("name", "prefill_tp", "decode_tp"), GRID)
def test_grid_exact_reads(name: str, prefill_tp: int, decode_tp: int) -> None:
    want = EXPECTED[name].get((prefill_tp, decode_tp))
    if want is None:
        with pytest.raises(LayoutMismatch) as err:
            plan_tp(prefill_tp, decode_tp, MODELS[name], model=name)
        msg = str(err.value)
        assert f"prefill TP {prefill_tp}" in msg and f"decode TP {decode_tp}" in msg
        assert repr(name) in msg and "\n" not in msg
        return
    num_slices, num_regions, reads, readers = want
    plan = plan_tp(prefill_tp, decode_tp, MODELS[name], model=name)
    assert (plan.prefill_tp, plan.decode_tp) == (prefill_tp, decode_tp)
    assert (plan.num_slices, plan.num_regions) == (num_slices, num_regions)
    assert as_tuples(plan) == reads
    assert descriptors_per_run(plan) == num_regions
    assert readers_per_prefill_rank(plan) == readers


@pytest.mark.parametrize(("name", "prefill_tp", "decode_tp"), SUPPORTED)
def test_grid_reads_assemble_exactly_the_decode_units(
    name: str, prefill_tp: int, decode_tp: int
) -> None:
    plan = plan_tp(prefill_tp, decode_tp, MODELS[name])
    for shard in MODELS[name]:
        for tp in (prefill_tp, decode_tp):
            for rank in range(tp):
                got = [list(u) for u in shard.rank_units(tp, rank)]
                assert got == ref_units(shard, tp, rank)
        for d in range(decode_tp):
            reads = plan.reads(d)
            assert [r.region_index for r in reads] == list(range(plan.num_regions))
            for f, want in enumerate(ref_units(shard, decode_tp, d)):
                assembled: list[int] = []
                for r in reads:
                    units = ref_units(shard, prefill_tp, r.prefill_rank)[f]
                    assert len(units) % plan.num_slices == 0
                    size = len(units) // plan.num_slices
                    assembled += units[r.slice_index * size:(r.slice_index + 1) * size]
                assert assembled == want, (d, shard, f)


def test_replicated_reads_prefer_the_rank_at_the_decode_ranks_position() -> None:
    # equal sizes read rank d even where rank 0 holds the same head (H=2 at TP 4)
    assert as_tuples(plan_tp(4, 4, [AttentionShards(num_kv_heads=2)]))[1] == ((1, 0, 0),)
    # MLA at 4 -> 2: decode 1 reads rank 2, not rank 0 a second time
    assert readers_per_prefill_rank(plan_tp(4, 2, [ReplicatedShards()])) == EVEN
    # H=2 at 4 -> 1: region 1 needs head 1 (ranks 2, 3): rank 2, its position
    assert as_tuples(plan_tp(4, 1, [AttentionShards(num_kv_heads=2)])) == (
        ((0, 0, 0), (2, 0, 1)),
    )


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "shards", "reason"),
    [
        (2, 3, [AttentionShards(num_kv_heads=12)], "divide neither way"),
        (3, 2, [AttentionShards(num_kv_heads=12)], "divide neither way"),
        (2, 3, [ReplicatedShards()], "divide neither way"),
        (2, 2, [AttentionShards(num_kv_heads=2), mamba2(128, 1, 4)], "'B' of 1 units"),
        (1, 2, [AttentionShards(num_kv_heads=2), mamba2(128, 1, 4)], "'B' of 1 units"),
        (2, 1, [AttentionShards(num_kv_heads=3)], "3 KV heads do not shard over TP 2"),
        (4, 2, MODELS["mixed"], "groups shard differently"),
        (2, 4, MODELS["mixed"], "groups shard differently"),
        (1, 2, [AttentionShards(num_kv_heads=8), ReplicatedShards()], "shard differently"),
    ],
)
def test_refusals_name_both_sides_the_model_and_the_fix(
    prefill_tp: int, decode_tp: int, shards: list[Shards], reason: str
) -> None:
    with pytest.raises(LayoutMismatch) as err:
        plan_tp(prefill_tp, decode_tp, shards, model="m-7b")
    msg = str(err.value)
    assert msg.startswith(
        f"cannot map prefill TP {prefill_tp} to decode TP {decode_tp} for model 'm-7b': "
    )
    assert reason in msg and "\n" not in msg
    assert "group 0 " in msg and "serve " in msg
    assert isinstance(err.value, ValueError)


def test_refusal_lists_each_groups_per_rank_counts() -> None:
    with pytest.raises(LayoutMismatch) as err:
        plan_tp(4, 2, MODELS["mixed"], model="mixed")
    assert str(err.value) == (
        "cannot map prefill TP 4 to decode TP 2 for model 'mixed': groups shard differently "
        "(one's decode page would be a slice of a prefill page, another's a whole page or "
        "several); per rank: group 0 attention (2 KV heads) holds 1 head (replicated x2) at "
        "prefill TP 4, 1 head at decode TP 2; group 1 state (x 128, B 4, C 4, ssm_heads 8) "
        "holds x 32, B 1, C 1, ssm_heads 2 at prefill TP 4, x 64, B 2, C 2, ssm_heads 4 at "
        "decode TP 2; serve prefill and decode at equal TP sizes, or at sizes where every "
        "group splits (or every group is replicated) the same way"
    )


def test_rank_units() -> None:
    assert AttentionShards(num_kv_heads=8).rank_units(2, 1) == (range(4, 8),)
    assert AttentionShards(num_kv_heads=2).rank_units(4, 3) == (range(1, 2),)
    assert ReplicatedShards().rank_units(8, 5) == (range(0, 1),)
    assert mamba2(128, 2, 4).rank_units(2, 1) == (
        range(64, 128), range(1, 2), range(1, 2), range(2, 4),
    )
    with pytest.raises(ValueError, match="6 KV heads do not shard over TP 4.*H=6, t=4"):
        AttentionShards(num_kv_heads=6).rank_units(4, 0)
    with pytest.raises(ValueError, match="3 KV heads do not shard over TP 2"):
        AttentionShards(num_kv_heads=3).rank_units(2, 0)
    with pytest.raises(ValueError, match="'B' of 1 units does not split over TP 2"):
        mamba2(128, 1, 4).rank_units(2, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        AttentionShards(num_kv_heads=8).rank_units(2, 2)


def test_shards_validate_their_fields() -> None:
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int, got 0"):
        AttentionShards(num_kv_heads=0)
    with pytest.raises(ValueError, match="non-empty tuple"):
        StateShards(fields=())
    with pytest.raises(ValueError, match="StateShards.x must be a positive int"):
        StateShards(fields=(("x", 0),))
    with pytest.raises(ValueError, match=r"\(name: str, units: int\)"):
        StateShards(fields=(("x",),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique"):
        StateShards(fields=(("x", 2), ("x", 4)))


def test_plan_tp_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="prefill_tp must be a positive int"):
        plan_tp(0, 1, [ReplicatedShards()])
    with pytest.raises(ValueError, match="one Shards per KV cache group"):
        plan_tp(1, 1, [])
    with pytest.raises(TypeError, match="got int"):
        plan_tp(1, 1, [8])  # type: ignore[list-item]


def test_plan_is_a_comparable_value_and_checks_its_table() -> None:
    plan = plan_tp(4, 2, [AttentionShards(num_kv_heads=8)], model="llama")
    assert plan == plan_tp(4, 2, [AttentionShards(num_kv_heads=8)], model="llama")
    assert hash(plan) == hash(plan_tp(4, 2, [AttentionShards(num_kv_heads=8)], model="llama"))
    assert plan.reads(1) == (
        Read(prefill_rank=2, slice_index=0, region_index=0),
        Read(prefill_rank=3, slice_index=0, region_index=1),
    )
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\) at TP 2, got 2"):
        plan.reads(2)
    with pytest.raises(ValueError, match="one per decode rank"):
        dataclasses.replace(plan, decode_tp=4)
    with pytest.raises(ValueError, match="must read regions 0..1 in order"):
        dataclasses.replace(plan, table=(plan.table[0], plan.table[1][::-1]))
    with pytest.raises(ValueError, match="from prefill ranks < 2"):
        dataclasses.replace(plan, prefill_tp=2)


def test_describe() -> None:
    assert describe(plan_tp(4, 2, [AttentionShards(num_kv_heads=8)], model="llama")) == (
        "TP 4 -> 2 (llama): S=1 R=2; d0 <- p0 p1; d1 <- p2 p3"
    )
    assert describe(plan_tp(1, 2, [AttentionShards(num_kv_heads=8)])) == (
        "TP 1 -> 2: S=2 R=1; d0 <- p0[0/2]; d1 <- p0[1/2]"
    )
    assert describe(plan_tp(4, 2, [ReplicatedShards()])) == "TP 4 -> 2: S=1 R=1; d0 <- p0; d1 <- p2"


def test_refuse_across_sizes_says_whether_the_pair_could_map() -> None:
    heads2 = [AttentionShards(num_kv_heads=2), AttentionShards(num_kv_heads=2)]
    # exact mapping exists: named, with the mapping, each side's heads per rank, the fix
    assert refuse_across_sizes(2, 1, heads2, model="gemma3", expected=1) == (
        "prefill TP 2 to decode TP 1 for model 'gemma3': this decode reads prefills at TP 1 "
        "(kvstage_peer_tp_size); the pair maps exactly (TP 2 -> 1 (gemma3): S=1 R=2; d0 <- "
        "p0 p1; per rank: group 0 attention (2 KV heads) holds 1 head at prefill TP 2, 2 "
        "heads at decode TP 1; group 1 attention (2 KV heads) holds 1 head at prefill TP 2, "
        "2 heads at decode TP 1): start the decode with kvstage_peer_tp_size=2 and the "
        "prefill with kvstage_peer_tp_size=1"
    )
    # cannot be exact: plan_tp's own refusal, both sizes and the model
    line = refuse_across_sizes(2, 3, [AttentionShards(num_kv_heads=12)], model="llama")
    assert line.startswith("cannot map prefill TP 2 to decode TP 3 for model 'llama'")
    assert "\n" not in line
