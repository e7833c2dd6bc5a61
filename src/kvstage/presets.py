"""Model presets (vLLM's grouping applied to real models' layer lists) and synthetic layouts.

Each preset is a list of ``(layer_name, spec)`` in model order, grouped with vLLM's rule
(`group_layers`); ``preset(name, num_blocks=...)`` builds its `KVLayout`.
"""

from __future__ import annotations

from kvstage.layout import (
    AttentionSpec,
    CacheLayout,
    FullAttentionSpec,
    KVGroup,
    KVLayout,
    MLASpec,
    SlidingWindowSpec,
    _require_positive,
    group_layers,
)


def synthetic_layout(
    *,
    num_layers: int,
    num_groups: int,
    num_blocks: int,
    block_size: int = 16,
    num_kv_heads: int = 4,
    head_size: int = 128,
    dtype: str = "float16",
    cache_layout: CacheLayout = CacheLayout.PACKED,
) -> KVLayout:
    """``num_layers`` layers striped over ``num_groups`` groups of one spec.

    Mirrors the seed benchmark's regime (16 layers, 32 KiB pages by default) with real
    hybrid aliasing: layer j goes to group j mod num_groups, so the pool has
    cdiv(num_layers, num_groups) physical tensors.
    """
    _require_positive("synthetic_layout", num_layers=num_layers, num_groups=num_groups)
    if num_groups > num_layers:
        raise ValueError(f"num_groups ({num_groups}) cannot exceed num_layers ({num_layers})")
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    names = [f"layers.{j}" for j in range(num_layers)]
    groups = tuple(
        KVGroup(group_id=g, layer_names=tuple(names[g::num_groups]), spec=spec)
        for g in range(num_groups)
    )
    return KVLayout(
        num_blocks=num_blocks,
        groups=groups,
        cache_layout=cache_layout,
        name=f"synthetic-{num_layers}L-{num_groups}G",
    )


def _gemma3_1b(bs: int) -> list[tuple[str, AttentionSpec]]:
    sw = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=256, sliding_window=512)
    fa = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=256)
    return [(f"layers.{i}", fa if i % 6 == 5 else sw) for i in range(26)]


def _llama31_8b(bs: int) -> list[tuple[str, AttentionSpec]]:
    fa = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128)
    return [(f"layers.{i}", fa) for i in range(32)]


def _gpt_oss_20b(bs: int) -> list[tuple[str, AttentionSpec]]:
    sw = SlidingWindowSpec(block_size=bs, num_kv_heads=8, head_size=64, sliding_window=128)
    fa = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=64)
    return [(f"layers.{i}", sw if i % 2 == 0 else fa) for i in range(24)]


def _deepseek_v2_lite(bs: int) -> list[tuple[str, AttentionSpec]]:
    mla = MLASpec(block_size=bs, head_size=512 + 64)
    return [(f"layers.{i}", mla) for i in range(27)]


PRESETS = {
    "gemma-3-1b": _gemma3_1b,
    "llama-3.1-8b": _llama31_8b,
    "gpt-oss-20b": _gpt_oss_20b,
    "deepseek-v2-lite": _deepseek_v2_lite,
}


def preset(
    name: str,
    *,
    num_blocks: int = 1024,
    block_size: int = 16,
    cache_layout: CacheLayout = CacheLayout.PACKED,
) -> KVLayout:
    """A model's KV layout: ``gemma-3-1b`` (7 groups, 4 tensors), ``llama-3.1-8b`` (1 group,
    32 tensors), ``gpt-oss-20b`` (2 groups, 12 tensors), ``deepseek-v2-lite`` (MLA, 27)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return KVLayout(
        num_blocks=num_blocks,
        groups=group_layers(PRESETS[name](block_size)),
        cache_layout=cache_layout,
        name=name,
    )
