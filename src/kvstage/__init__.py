"""kvstage: paged KV-cache blocks through a host buffer for P/D disaggregation.

Importing kvstage never touches CUDA, NIXL or vLLM; those load lazily where they are used
(`kvstage.transport.nixl`, `kvstage.integrations.vllm`).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kvstage.blocks import NULL_BLOCK, BlockPool, GroupedBlockIds, clip_to_window
from kvstage.cache import HostBuffer, HostLayout, KVCache, layout_from_layers, memory_report
from kvstage.engine import CopyEngine, CopyStats, Direction
from kvstage.errors import KVStageError
from kvstage.layout import (
    AttentionSpec,
    CacheLayout,
    FullAttentionSpec,
    KVGroup,
    KVLayout,
    MLASpec,
    SlidingWindowSpec,
    group_layers,
)
from kvstage.plan import CopyPlan, find_runs, plan_copy
from kvstage.presets import PRESETS, preset, synthetic_layout

try:
    __version__ = version("kvstage")  # one place: pyproject.toml
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

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
    "FullAttentionSpec",
    "GroupedBlockIds",
    "HostBuffer",
    "HostLayout",
    "KVCache",
    "KVGroup",
    "KVLayout",
    "KVStageError",
    "MLASpec",
    "SlidingWindowSpec",
    "Strategy",
    "clip_to_window",
    "find_runs",
    "group_layers",
    "layout_from_layers",
    "memory_report",
    "plan_copy",
    "preset",
    "synthetic_layout",
]


def __getattr__(name: str) -> Any:
    # the baselines' strategy names stay importable from kvstage, without the product
    # package importing the testing module
    if name == "Strategy":
        from kvstage.testing.baselines import Strategy

        return Strategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
