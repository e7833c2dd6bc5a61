"""The connector across tensor-parallel sizes: vLLM's pages cut into the parts a mapping reads.

Contract
--------
- `group_shards(layout, tp_size, total_kv_heads)`: each KV cache group's shards over TP
  ranks (`kvstage.pd.tp_shards`) from kvstage's specs of one rank (this rank's heads or
  state units times the TP size; one head per rank over ``total_kv_heads`` is a replica).
- `cut_pages(kv_caches, groups, layout, num_parts, model)`: every group's page cut into
  ``num_parts`` (`kvstage.pd.tp_parts`): attention pages by head from the layer tensor's
  shape and strides, MLA whole, Mamba2 / gated delta net state by field.
- `prefill_side` / `decode_side`: the `TPSide` and mapping of one rank of a prefill
  started for decodes at ``peer_tp`` (S slices, the decode ranks that read it) or of a
  decode started for prefills at ``peer_tp`` (its reads: one region per prefill rank).
  A pair that cannot be exact raises `LayoutMismatch` in one line (both sizes, each
  group's per-rank counts, the model): the instance does not start.

torch and numpy only; vLLM's tensors are read, never copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvstage.layout import KVLayout, MambaSpec, MLASpec
from kvstage.pd.tp_map import (
    AttentionShards,
    Read,
    ReplicatedShards,
    Shards,
    StateShards,
    plan_tp,
    readers_per_prefill_rank,
)
from kvstage.pd.tp_parts import (
    PageParts,
    TPSide,
    head_units,
    page_parts,
    state_fields,
    state_units,
)

__all__ = ["cut_pages", "decode_side", "group_shards", "prefill_side"]


def group_shards(layout: KVLayout, tp_size: int, total_kv_heads: int) -> list[Shards]:
    """Each group's shards (module doc)."""
    out: list[Shards] = []
    for group in layout.groups:
        spec = group.spec
        if isinstance(spec, MLASpec):
            out.append(ReplicatedShards())
        elif isinstance(spec, MambaSpec):
            fields, _ = state_fields(spec)
            out.append(StateShards(fields=tuple((n, u * tp_size) for n, u in fields)))
        else:
            per_rank = int(spec.num_kv_heads)
            heads = per_rank * tp_size
            if per_rank == 1 and 0 < total_kv_heads < heads:
                heads = total_kv_heads
            out.append(AttentionShards(num_kv_heads=heads))
    return out


def cut_pages(kv_caches: Mapping[str, torch.Tensor],
              groups: Sequence[tuple[Sequence[str], Any]], layout: KVLayout, num_parts: int,
              model: str = "") -> PageParts:
    """Every group's page of ``layout`` (built from ``kv_caches`` and vLLM's ``groups``)
    cut into ``num_parts`` (module doc)."""
    page = layout.page_size_bytes
    maps = []
    for (names, _), group in zip(groups, layout.groups, strict=True):
        spec = group.spec
        if isinstance(spec, MambaSpec):
            maps.append(state_units(spec, page))
        elif isinstance(spec, MLASpec):
            maps.append(((np.zeros(page, np.int64), np.zeros(page, np.int64)),
                         [("latent", 1)]))
        else:
            t = kv_caches[names[0]]
            units = head_units(t.shape, t.stride(), t.element_size(), page,
                               int(spec.num_kv_heads))
            maps.append((units, [("heads", int(spec.num_kv_heads))]))
    return page_parts(maps, num_parts, page, layout.num_tensors, model=model)


def prefill_side(kv_caches: Mapping[str, torch.Tensor],
                 groups: Sequence[tuple[Sequence[str], Any]], layout: KVLayout, *,
                 tp_size: int, rank: int, peer_tp: int, total_kv_heads: int,
                 model: str = "") -> tuple[TPSide, int]:
    """A prefill rank serving decodes at ``peer_tp``: its TPSide (S slices) and how many
    decode ranks read it."""
    shards = group_shards(layout, tp_size, total_kv_heads)
    plan = plan_tp(tp_size, peer_tp, shards, model=model)
    parts = cut_pages(kv_caches, groups, layout, plan.num_slices, model)
    return (TPSide(size=tp_size, rank=rank, peer_size=peer_tp, parts=parts),
            readers_per_prefill_rank(plan)[rank])


def decode_side(kv_caches: Mapping[str, torch.Tensor],
                groups: Sequence[tuple[Sequence[str], Any]], layout: KVLayout, *,
                tp_size: int, rank: int, peer_tp: int, total_kv_heads: int,
                model: str = "") -> tuple[TPSide, tuple[Read, ...], int]:
    """A decode rank reading prefills at ``peer_tp``: its TPSide (R regions), its reads
    (region j from a prefill rank's slice) and the prefill's S."""
    shards = group_shards(layout, tp_size, total_kv_heads)
    plan = plan_tp(peer_tp, tp_size, shards, model=model)
    parts = cut_pages(kv_caches, groups, layout, plan.num_regions, model)
    return (TPSide(size=tp_size, rank=rank, peer_size=peer_tp, parts=parts),
            plan.reads(rank), plan.num_slices)
