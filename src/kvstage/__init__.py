"""kvstage: paged KV-cache blocks through a host buffer for P/D disaggregation.

Importing kvstage never touches CUDA or NIXL; those load lazily where they are used.
"""

from kvstage.blocks import NULL_BLOCK, BlockPool, GroupedBlockIds, clip_to_window
from kvstage.engine import CopyEngine, CopyStats, Direction, Strategy
from kvstage.host_buffer import HostBuffer, HostLayout, KVCache, memory_report
from kvstage.layout import (
    PRESETS,
    AttentionSpec,
    CacheLayout,
    KVGroup,
    KVLayout,
    MLASpec,
    SlidingWindowSpec,
    group_layers,
    preset,
    synthetic_layout,
)
from kvstage.plan import CopyPlan, find_runs, plan_copy

__version__ = "0.1.0"

__all__ = [
    "NULL_BLOCK",
    "PRESETS",
    "AttentionSpec",
    "BlockPool",
    "CacheLayout",
    "CopyEngine",
    "CopyPlan",
    "CopyStats",
    "Direction",
    "GroupedBlockIds",
    "HostBuffer",
    "HostLayout",
    "KVCache",
    "KVGroup",
    "KVLayout",
    "MLASpec",
    "SlidingWindowSpec",
    "Strategy",
    "clip_to_window",
    "find_runs",
    "group_layers",
    "memory_report",
    "plan_copy",
    "preset",
    "synthetic_layout",
]
