"""Model presets (vLLM's grouping applied to real models' layer lists) and synthetic layouts.

Each preset is a list of ``(layer_name, spec)`` in model order, grouped with vLLM's rule
(`group_layers`); ``preset(name, num_blocks=...)`` builds its `KVLayout`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvstage.layout import (
    AttentionSpec,
    CacheLayout,
    FullAttentionSpec,
    KVGroup,
    KVLayout,
    KVSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
    _require_positive,
    cdiv,
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


def unify_hybrid(
    attention: FullAttentionSpec, state: MambaSpec, *, alignment: int
) -> tuple[FullAttentionSpec, MambaSpec]:
    """vLLM's page unification for attention + state hybrids
    (``Platform._align_hybrid_block_size``): the attention block grows, in multiples of
    ``alignment`` tokens (the kernel block size), until its page holds a state slot, then
    the state page is padded to the attention page. Granite 4.0-H-Tiny in bf16: a state
    slot is 806,400 B, a token of attention 2,048 B -> 400-token blocks, pages of
    819,200 B (state padded by 1.6 %)."""
    per_token = replace(attention, block_size=1).page_size_bytes
    block_size = alignment * cdiv(state.state_bytes, alignment * per_token)
    attn = replace(attention, block_size=block_size)
    return attn, state.padded_to(attn.page_size_bytes)


def _hybrid(pattern: str, attention: FullAttentionSpec, state: MambaSpec,
            alignment: int) -> list[tuple[str, KVSpec]]:
    """Layers from a pattern of ``A`` (attention) and ``S`` (state) layers."""
    attn, st = unify_hybrid(attention, state, alignment=alignment)
    return [(f"layers.{i}", attn if c == "A" else st) for i, c in enumerate(pattern)]


# From the published config.json files (no weights): layer pattern, attention heads, the
# state shapes vLLM derives (DS conv layout), bf16 (vLLM's "auto" state dtypes).
def _granite_4_0_h_tiny(bs: int) -> list[tuple[str, KVSpec]]:
    """40 layers: attention at 5, 15, 25, 35, Mamba2 elsewhere (hidden 1536, 48 heads x
    64, d_state 128, 1 group, conv 4); attention 4 KV heads x 128."""
    pattern = "".join("A" if i in (5, 15, 25, 35) else "S" for i in range(40))
    state = MambaSpec.mamba2(block_size=131072, intermediate_size=48 * 64, n_groups=1,
                             num_heads=48, head_dim=64, state_size=128, conv_kernel=4)
    fa = FullAttentionSpec(block_size=bs, num_kv_heads=4, head_size=128)
    return _hybrid(pattern, fa, state, bs)


NEMOTRON_NANO_9B_V2_PATTERN = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"


def _nemotron_nano_9b_v2(bs: int) -> list[tuple[str, KVSpec]]:
    """56 layers (``hybrid_override_pattern``): 27 Mamba2 ``M`` (128 heads x 80, d_state
    128, 8 groups, conv 4), 4 attention ``*`` (8 KV heads x 128), 25 MLP ``-`` (no cache)."""
    pattern = "".join({"M": "S", "*": "A"}.get(c, "") for c in NEMOTRON_NANO_9B_V2_PATTERN)
    state = MambaSpec.mamba2(block_size=131072, intermediate_size=128 * 80, n_groups=8,
                             num_heads=128, head_dim=80, state_size=128, conv_kernel=4)
    fa = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128)
    return _hybrid(pattern, fa, state, bs)


def _qwen3_next_80b_a3b(bs: int) -> list[tuple[str, KVSpec]]:
    """48 layers, every 4th full attention (2 KV heads x 256), the rest gated delta net
    (16 key heads x 128, 32 value heads x 128, conv 4)."""
    pattern = "".join("A" if i % 4 == 3 else "S" for i in range(48))
    state = MambaSpec.gated_delta_net(block_size=262144, num_k_heads=16, num_v_heads=32,
                                      head_k_dim=128, head_v_dim=128, conv_kernel=4)
    fa = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=256)
    return _hybrid(pattern, fa, state, bs)


PRESETS: dict[str, Callable[[int], Sequence[tuple[str, KVSpec]]]] = {
    "gemma-3-1b": _gemma3_1b,
    "llama-3.1-8b": _llama31_8b,
    "gpt-oss-20b": _gpt_oss_20b,
    "deepseek-v2-lite": _deepseek_v2_lite,
    "granite-4.0-h-tiny": _granite_4_0_h_tiny,
    "nemotron-nano-9b-v2": _nemotron_nano_9b_v2,
    "qwen3-next-80b-a3b": _qwen3_next_80b_a3b,
}


#: presets with state groups (MambaSpec): packed cache layout only
STATE_PRESETS = ("granite-4.0-h-tiny", "nemotron-nano-9b-v2", "qwen3-next-80b-a3b")


def cache_layouts_for(name: str) -> list[CacheLayout]:
    """The cache layouts a preset can take: K/V split needs two planes in every group (MLA
    latents and state pages have one)."""
    if name in STATE_PRESETS or name == "deepseek-v2-lite":
        return [CacheLayout.PACKED]
    return list(CacheLayout)


def synthetic_hybrid_layout(
    *,
    num_attention: int,
    num_state: int,
    num_blocks: int,
    alignment: int = 2,
    num_kv_heads: int = 1,
    head_size: int = 8,
    dtype: str = "bfloat16",
    ssm_dtype: str = "float32",
) -> KVLayout:
    """A small Mamba2 + attention hybrid (attention every ``num_state // num_attention + 1``
    layers), pages unified as vLLM does; fp32 SSM state beside bf16 pages by default, so
    the pool is byte-addressed. For tests and sweeps: real presets' pages are MiBs."""
    _require_positive("synthetic_hybrid_layout", num_attention=num_attention,
                      num_state=num_state, num_blocks=num_blocks, alignment=alignment)
    state = MambaSpec.mamba2(block_size=4096, intermediate_size=8, n_groups=1, num_heads=2,
                             head_dim=4, state_size=4, conv_kernel=4, dtype=dtype,
                             ssm_dtype=ssm_dtype)
    fa = FullAttentionSpec(block_size=alignment, num_kv_heads=num_kv_heads,
                           head_size=head_size, dtype=dtype)
    every = num_state // num_attention + 1
    pattern, a, s = "", 0, 0
    while a < num_attention or s < num_state:
        take_attn = s >= num_state or (a < num_attention and len(pattern) % every == every - 1)
        pattern += "A" if take_attn else "S"
        a, s = a + take_attn, s + (not take_attn)
    return KVLayout(num_blocks=num_blocks, groups=group_layers(_hybrid(pattern, fa, state,
                    alignment)), name=f"synthetic-hybrid-{num_attention}A-{num_state}S")


def preset(
    name: str,
    *,
    num_blocks: int = 1024,
    block_size: int = 16,
    cache_layout: CacheLayout = CacheLayout.PACKED,
) -> KVLayout:
    """A model's KV layout: ``gemma-3-1b`` (7 groups, 4 tensors), ``llama-3.1-8b`` (1 group,
    32 tensors), ``gpt-oss-20b`` (2 groups, 12 tensors), ``deepseek-v2-lite`` (MLA, 27),
    and the state hybrids ``granite-4.0-h-tiny`` (9 Mamba2 + 1 attention group, 4
    tensors), ``nemotron-nano-9b-v2`` (7 + 1, 4) and ``qwen3-next-80b-a3b`` (3 GDN + 1
    attention, 12). For the hybrids ``block_size`` is the kernel alignment: the attention
    block is what vLLM's page unification makes of it (`unify_hybrid`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return KVLayout(
        num_blocks=num_blocks,
        groups=group_layers(PRESETS[name](block_size)),
        cache_layout=cache_layout,
        name=name,
    )
