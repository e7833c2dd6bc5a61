"""Which prefill ranks, and which slice of each, a decode rank reads when prefill and decode
run at different tensor-parallel (TP) sizes.

A KV cache group's page shards over ranks as `kvstage.pd.tp_shards` says (attention heads,
split or replicated; MLA's latent, whole; a state's fields, split).

`plan_tp` computes, per group and field, the set of global units each rank holds on each
side, and derives a decode rank's reads from set inclusion: slice i of S of a prefill rank's
page holds units [i*u/S, (i+1)*u/S) of each of its fields of u units, and region j of R of
a decode rank's page receives its j-th read, in unit order. One (slice, region) per read
covers every group, so the reads must be identical for every group and field; the result
is a `TPPlan` (S, R and each decode rank's reads), or `LayoutMismatch` in one line
(both TP sizes, each group's per-rank counts, the model, the fix). A wrong mapping is never
returned. Where several prefill ranks hold exactly a region's units (replicated heads,
MLA), the one at the decode rank's own position is chosen (prefill rank d at equal sizes,
d*k at prefill TP k x decode TP, d // k at decode TP k x prefill TP), else the
lowest-numbered.

Pure: no torch, numpy or I/O; every name here is a frozen value, safe to share across
threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstage.errors import LayoutMismatch
from kvstage.pd.tp_shards import (
    AttentionShards,
    ReplicatedShards,
    Shards,
    StateShards,
    check_rank,
    require_positive,
)

__all__ = [
    "AttentionShards",
    "Read",
    "ReplicatedShards",
    "Shards",
    "StateShards",
    "TPPlan",
    "describe",
    "descriptors_per_run",
    "plan_tp",
    "readers_per_prefill_rank",
    "refuse_across_sizes",
]


@dataclass(frozen=True, kw_only=True)
class Read:
    """A decode rank reads slice ``slice_index`` of S of prefill rank ``prefill_rank``'s page
    into region ``region_index`` of R of its own page."""

    prefill_rank: int
    slice_index: int
    region_index: int


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """The reads of every decode rank: ``table[d]`` is decode rank d's reads, in region
    order. ``num_slices`` (S): equal slices each prefill page is cut into, 1 when read whole;
    ``num_regions`` (R): prefill ranks each decode rank assembles its page from."""

    prefill_tp: int
    decode_tp: int
    num_slices: int
    num_regions: int
    table: tuple[tuple[Read, ...], ...]
    model: str = ""

    def __post_init__(self) -> None:
        for name in ("prefill_tp", "decode_tp", "num_slices", "num_regions"):
            require_positive("TPPlan", name, getattr(self, name))
        if len(self.table) != self.decode_tp:
            raise ValueError(
                f"TPPlan.table has {len(self.table)} rows, expected one per decode rank "
                f"({self.decode_tp})"
            )
        for d, reads in enumerate(self.table):
            regions = [r.region_index for r in reads]
            bad = [
                r for r in reads
                if not (0 <= r.prefill_rank < self.prefill_tp
                        and 0 <= r.slice_index < self.num_slices)
            ]
            if regions != list(range(self.num_regions)) or bad:
                raise ValueError(
                    f"TPPlan.table[{d}] = {reads} must read regions 0..{self.num_regions - 1} "
                    f"in order, from prefill ranks < {self.prefill_tp} and slices < "
                    f"{self.num_slices}"
                )

    def reads(self, decode_rank: int) -> tuple[Read, ...]:
        """Decode rank ``decode_rank``'s reads, in region order (``num_regions`` of them)."""
        check_rank(self.decode_tp, decode_rank)
        return self.table[decode_rank]


def _per_rank(prefill_tp: int, decode_tp: int, shards: Sequence[Shards]) -> str:
    """Each group's per-rank counts on both sides, for a one-line message."""
    return "; ".join(
        f"group {g} {s.label()} holds {s.per_rank(prefill_tp)} at prefill TP {prefill_tp}, "
        f"{s.per_rank(decode_tp)} at decode TP {decode_tp}"
        for g, s in enumerate(shards)
    )


def _refusal(prefill_tp: int, decode_tp: int, shards: Sequence[Shards], model: str,
             reason: str, fix: str) -> LayoutMismatch:
    """One line: both TP sizes, the model, what is wrong, each group's per-rank counts, fix."""
    groups = _per_rank(prefill_tp, decode_tp, shards)
    of_model = f" for model {model!r}" if model else ""
    return LayoutMismatch(
        f"cannot map prefill TP {prefill_tp} to decode TP {decode_tp}{of_model}: {reason}; "
        f"per rank: {groups}; {fix}"
    )


def _units(shards: Sequence[Shards], tp: int) -> list[list[range]]:
    """``[rank][field]``: every group's fields flattened, in group order (ValueError naming
    the group where one does not shard at ``tp``)."""
    table: list[list[range]] = [[] for _ in range(tp)]
    for g, s in enumerate(shards):
        for rank in range(tp):
            try:
                table[rank].extend(s.rank_units(tp, rank))
            except ValueError as exc:
                raise ValueError(f"group {g}: {exc}") from None
    return table


def _shape(prefill_size: int, decode_size: int) -> tuple[int, int] | None:
    """(S, R) for a field whose prefill rank holds ``prefill_size`` units and decode rank
    ``decode_size``: 8 -> 4 is (2, 1), 4 -> 8 is (1, 2); None when neither divides."""
    if prefill_size >= decode_size:
        return (prefill_size // decode_size, 1) if prefill_size % decode_size == 0 else None
    return (1, decode_size // prefill_size) if decode_size % prefill_size == 0 else None


def _slice(units: range, index: int, num_slices: int) -> range:
    size = len(units) // num_slices
    return units[index * size:(index + 1) * size]


def plan_tp(prefill_tp: int, decode_tp: int, shards: Sequence[Shards], *,
            model: str = "") -> TPPlan:
    """Map every decode rank to the prefill ranks (and slices) holding its page's units.

    ``shards``: one per KV cache group, in group order. Refuses with `LayoutMismatch` (one
    line) when a group's units do not shard at a side's TP, when the TP sizes divide neither
    way, or when groups would need different reads (one replicated and one split). Equal
    sizes: decode rank d reads prefill rank d; decode TP k x prefill TP: slice d % k of k of
    prefill rank d // k; prefill TP k x decode TP: prefill ranks d*k .. d*k+k-1 whole into
    regions 0..k-1. Replicated heads and MLA fall out of the same set inclusion with fewer
    reads (MLA: one whole page per decode rank; H=2 at prefill TP 4 -> decode TP 1: ranks 0
    and 2, one per head). Cost: decode_tp x R x prefill_tp x S comparisons per field.
    """
    require_positive("plan_tp", "prefill_tp", prefill_tp)
    require_positive("plan_tp", "decode_tp", decode_tp)
    shards = tuple(shards)
    if not shards:
        raise ValueError("plan_tp needs one Shards per KV cache group, got none")
    for s in shards:
        if not isinstance(s, AttentionShards | ReplicatedShards | StateShards):
            raise TypeError(
                f"plan_tp shards must be AttentionShards, ReplicatedShards or StateShards, "
                f"got {type(s).__name__}"
            )

    def refuse(reason: str, fix: str) -> LayoutMismatch:
        return _refusal(prefill_tp, decode_tp, shards, model, reason, fix)

    try:
        prefill_units = _units(shards, prefill_tp)
        decode_units = _units(shards, decode_tp)
    except ValueError as exc:
        raise refuse(
            str(exc),
            "serve each side at a TP size every group's head and state unit counts shard "
            "over (vLLM cannot run the model otherwise)",
        ) from None
    if prefill_tp % decode_tp and decode_tp % prefill_tp:
        raise refuse(
            "the TP sizes divide neither way",
            "serve prefill and decode at TP sizes where one divides the other "
            "(e.g. 2 and 4, or equal sizes)",
        )
    differently = (
        "groups shard differently (one's decode page would be a slice of a prefill page, "
        "another's a whole page or several)",
        "serve prefill and decode at equal TP sizes, or at sizes where every group splits "
        "(or every group is replicated) the same way",
    )
    # Every rank of a side holds equally many units of a field, so (S, R) per field is
    # decided by rank 0's counts on both sides; all fields must agree.
    shapes = {
        _shape(len(p), len(d)) for p, d in zip(prefill_units[0], decode_units[0], strict=True)
    }
    shape = shapes.pop()
    if shapes or shape is None:  # None: cannot happen once one TP divides the other
        raise refuse(*differently)
    num_slices, num_regions = shape
    table: list[tuple[Read, ...]] = []
    for d in range(decode_tp):
        reads: list[Read] = []
        for j in range(num_regions):
            targets = [_slice(units, j, num_regions) for units in decode_units[d]]
            candidates = [
                (p, i)
                for p in range(prefill_tp)
                for i in range(num_slices)
                if all(
                    _slice(units, i, num_slices) == target
                    for units, target in zip(prefill_units[p], targets, strict=True)
                )
            ]
            if not candidates:
                raise refuse(*differently)
            # the prefill rank at this region's position spreads replicated reads over the
            # prefill ranks (MLA at 4 -> 2: decode 1 reads rank 2, not rank 0 again)
            natural = (d * num_regions + j) * prefill_tp // (decode_tp * num_regions)
            p, i = next(((p, i) for p, i in candidates if p == natural), candidates[0])
            reads.append(Read(prefill_rank=p, slice_index=i, region_index=j))
        table.append(tuple(reads))
    return TPPlan(
        prefill_tp=prefill_tp, decode_tp=decode_tp, num_slices=num_slices,
        num_regions=num_regions, table=tuple(table), model=model,
    )


def descriptors_per_run(plan: TPPlan) -> int:
    """READ descriptors per run of consecutive blocks per decode rank: ``len(reads(d))``,
    which is R for every d (the host layout keeps each slice of a run contiguous). Per
    request per decode rank: runs x R descriptors; with S > 1 slices, a prefill rank's run is
    read by the S decode ranks that split it, one slice each (`readers_per_prefill_rank`
    gives the exact count, replicated pages included)."""
    return len(plan.reads(0))


def readers_per_prefill_rank(plan: TPPlan) -> dict[int, int]:
    """Prefill rank -> how many decode ranks read it (0 for one nobody reads: replicated
    pages are read once). A prefill rank frees a request's blocks only after all of them."""
    counts = dict.fromkeys(range(plan.prefill_tp), 0)
    for reads in plan.table:
        for p in {r.prefill_rank for r in reads}:
            counts[p] += 1
    return counts


def describe(plan: TPPlan) -> str:
    """One line for logs: ``TP 4 -> 2 (llama): S=1 R=2; d0 <- p0 p1; d1 <- p2 p3`` (a slice
    shows as ``p0[1/2]``: slice 1 of 2)."""

    def one(r: Read) -> str:
        if plan.num_slices == 1:
            return f"p{r.prefill_rank}"
        return f"p{r.prefill_rank}[{r.slice_index}/{plan.num_slices}]"

    of_model = f" ({plan.model})" if plan.model else ""
    rows = "; ".join(
        f"d{d} <- " + " ".join(one(r) for r in reads) for d, reads in enumerate(plan.table)
    )
    return (
        f"TP {plan.prefill_tp} -> {plan.decode_tp}{of_model}: "
        f"S={plan.num_slices} R={plan.num_regions}; {rows}"
    )


def refuse_across_sizes(prefill_tp: int, decode_tp: int, shards: Sequence[Shards], *,
                        model: str = "", expected: int | None = None) -> str:
    """The one line a decode at ``decode_tp``, started to read prefills at ``expected`` TP
    (its host buffer is cut for them: ``kvstage_peer_tp_size``), gives for a request whose
    prefill ran at ``prefill_tp``: whether that pair could be exact (the mapping it would
    use, or `plan_tp`'s refusal: both sizes, each group's per-rank counts, the model) and
    the settings that serve it."""
    of_model = f" for model {model!r}" if model else ""
    expected = decode_tp if expected is None else expected
    try:
        plan = plan_tp(prefill_tp, decode_tp, shards, model=model)
    except LayoutMismatch as exc:
        return str(exc)
    return (f"prefill TP {prefill_tp} to decode TP {decode_tp}{of_model}: this decode reads "
            f"prefills at TP {expected} (kvstage_peer_tp_size); the pair maps exactly "
            f"({describe(plan)}; per rank: {_per_rank(prefill_tp, decode_tp, shards)}): start "
            f"the decode with kvstage_peer_tp_size={prefill_tp} and the prefill with "
            f"kvstage_peer_tp_size={decode_tp}")
