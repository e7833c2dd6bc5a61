"""How one KV cache group's page shards over tensor-parallel (TP) ranks.

Each TP rank's KV page of a block holds only that rank's shard of each layer. A group's
shard is one of three kinds, each a list of fields of global *units* (heads, or a state's
channels / groups / heads):

- `AttentionShards`: ``num_kv_heads`` H, vLLM's rule at TP t: H >= t splits evenly (rank r
  holds heads [r*H/t, (r+1)*H/t)), H < t replicates (rank r holds head r // (t/H));
- `ReplicatedShards`: MLA's latent, the whole page on every rank;
- `StateShards`: a state-space / linear-attention page of named fields, each split evenly
  along its own units (never replicated).

`kvstage.pd.tp_map` maps a prefill's ranks onto a decode's from these. Pure: no torch,
numpy or I/O; every name is a frozen value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "AttentionShards", "ReplicatedShards", "Shards", "StateShards", "check_rank",
    "require_positive",
]


def require_positive(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"{owner}.{name} must be a positive int, got {value!r}; pass e.g. {name}=2"
        )


def check_rank(tp: int, rank: int) -> None:
    require_positive("TP", "size", tp)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}) at TP {tp}, got {rank!r}")


def _split(name: str, units: int, tp: int, rank: int) -> range:
    """Rank ``rank``'s units of an even split of ``units`` over ``tp`` ranks."""
    if units % tp:
        raise ValueError(
            f"state field {name!r} of {units} units does not split over TP {tp}: it needs "
            f"{units} % {tp} == 0 (states are never replicated)"
        )
    per_rank = units // tp
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass(frozen=True, kw_only=True)
class AttentionShards:
    """An attention group's page: ``num_kv_heads`` (global H) KV heads, one field "heads"."""

    num_kv_heads: int

    def __post_init__(self) -> None:
        require_positive("AttentionShards", "num_kv_heads", self.num_kv_heads)

    @property
    def fields(self) -> tuple[tuple[str, int], ...]:
        return (("heads", self.num_kv_heads),)

    def rank_units(self, tp: int, rank: int) -> tuple[range, ...]:
        """Global heads rank ``rank`` holds at TP ``tp``, one range per field (H=8, t=2, r=1:
        (range(4, 8),); H=2, t=4, r=3: (range(1, 2),)). ValueError where vLLM cannot run."""
        check_rank(tp, rank)
        heads = self.num_kv_heads
        if heads >= tp and heads % tp == 0:
            per_rank = heads // tp
            return (range(rank * per_rank, (rank + 1) * per_rank),)
        if heads < tp and tp % heads == 0:
            head = rank // (tp // heads)
            return (range(head, head + 1),)
        raise ValueError(
            f"{heads} KV heads do not shard over TP {tp}: vLLM needs H % t == 0 (H >= t) or "
            f"t % H == 0 (H < t), here H={heads}, t={tp}"
        )

    def per_rank(self, tp: int) -> str:
        heads = self.num_kv_heads
        if heads >= tp and heads % tp == 0:
            return "1 head" if heads == tp else f"{heads // tp} heads"
        if heads < tp and tp % heads == 0:
            return f"1 head (replicated x{tp // heads})"
        return f"{heads}/{tp} heads (does not shard)"

    def label(self) -> str:
        heads = self.num_kv_heads
        return f"attention ({heads} KV head{'' if heads == 1 else 's'})"


@dataclass(frozen=True, kw_only=True)
class ReplicatedShards:
    """A page every rank holds whole (MLA's latent): one field "latent" of one unit."""

    @property
    def fields(self) -> tuple[tuple[str, int], ...]:
        return (("latent", 1),)

    def rank_units(self, tp: int, rank: int) -> tuple[range, ...]:
        check_rank(tp, rank)
        return (range(0, 1),)

    def per_rank(self, tp: int) -> str:
        return "the whole page"

    def label(self) -> str:
        return "replicated (MLA latent)"


@dataclass(frozen=True, kw_only=True)
class StateShards:
    """A state page of named fields, each split evenly along its global unit count: Mamba2
    (DS conv layout) ``(("x", intermediate_size), ("B", n_groups), ("C", n_groups),
    ("ssm_heads", num_heads))``; a gated delta net ``(("q", num_k_heads), ("k",
    num_k_heads), ("v", num_v_heads), ("state_heads", num_v_heads))``."""

    fields: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.fields, tuple) or not self.fields:
            raise ValueError(
                f"StateShards.fields must be a non-empty tuple of (name, units), got "
                f"{self.fields!r}; pass e.g. fields=(('x', 128), ('B', 2))"
            )
        for field in self.fields:
            if not (isinstance(field, tuple) and len(field) == 2 and isinstance(field[0], str)):
                raise ValueError(
                    f"StateShards.fields entries must be (name: str, units: int), got {field!r}"
                )
            require_positive("StateShards", field[0], field[1])
        names = [name for name, _ in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"StateShards.fields names must be unique, got {names}")

    def rank_units(self, tp: int, rank: int) -> tuple[range, ...]:
        """Global units of each field rank ``rank`` holds at TP ``tp`` (ValueError where a
        field's units do not divide by ``tp``)."""
        check_rank(tp, rank)
        return tuple(_split(name, units, tp, rank) for name, units in self.fields)

    def per_rank(self, tp: int) -> str:
        return ", ".join(
            f"{name} {units // tp}" if units % tp == 0 else f"{name} {units}/{tp} (does not split)"
            for name, units in self.fields
        )

    def label(self) -> str:
        return "state (" + ", ".join(f"{name} {units}" for name, units in self.fields) + ")"


Shards: TypeAlias = AttentionShards | ReplicatedShards | StateShards
