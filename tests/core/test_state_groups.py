"""State groups (vLLM's MambaSpec: Mamba2, gated delta net) in the layout, the plan and the
copy engine: the same guarantees as attention groups, asserted exactly.

- The spec: slot bytes from the published shapes, vLLM's page unification (attention blocks
  of 400 tokens for Granite 4.0-H-Tiny in bf16, 544 for Qwen3-Next), one slot per request
  whatever its length, bad input refused in one line.
- The layout: state pages share physical tensors with attention pages; a pool of bf16
  attention beside fp32 state is byte-addressed; K/V split refused; the side-channel codec
  round-trips it.
- The copy: every preset with state groups, both directions, both host layouts, direct and
  staged, byte-exact against the naive per-block copy; one op per run over every tensor;
  host bytes equal the device pool.
"""

from __future__ import annotations

import pytest
import torch

from kvstage import (
    CopyEngine,
    Direction,
    GroupedBlockIds,
    HostBuffer,
    HostLayout,
    KVCache,
    memory_report,
)
from kvstage.blocks import clip_to_window, request_blocks
from kvstage.layout import CacheLayout, FullAttentionSpec, KVGroup, KVLayout, MambaSpec
from kvstage.pd.messages import layout_from_msg, layout_to_msg
from kvstage.plan import INDEX_BYTES, plan_copy
from kvstage.presets import STATE_PRESETS, preset, synthetic_hybrid_layout, unify_hybrid
from kvstage.testing.opcount import OpCounter
from tests.helpers import as_bytes, check_invariants, make_pair


def _granite_state() -> MambaSpec:
    return MambaSpec.mamba2(block_size=131072, intermediate_size=3072, n_groups=1,
                            num_heads=48, head_dim=64, state_size=128, conv_kernel=4)


def test_mamba2_slot_bytes_from_the_published_shapes() -> None:
    spec = _granite_state()
    # DS conv (3072 + 2 x 1 x 128, 4 - 1), ssm (48, 64, 128), bf16
    assert spec.shapes == ((3328, 3), (48, 64, 128))
    assert spec.state_bytes == 3328 * 3 * 2 + 48 * 64 * 128 * 2 == 806400
    assert spec.state_offsets() == (0, 19968)
    assert spec.page_size_bytes == 806400
    assert spec.dtype == "bfloat16" and spec.num_kv_planes == 1
    # the state does not grow with the prompt: one running slot (+ scratch slots)
    assert spec.max_blocks_per_request(1) == spec.max_blocks_per_request(10**6) == 1
    spec2 = MambaSpec(block_size=8, shapes=((4, 3),), dtypes=("float32",),
                      num_speculative_blocks=2)
    assert spec2.max_blocks_per_request(5) == 3


def test_gdn_slot_bytes() -> None:
    spec = MambaSpec.gated_delta_net(block_size=262144, num_k_heads=16, num_v_heads=32,
                                     head_k_dim=128, head_v_dim=128, conv_kernel=4)
    assert spec.shapes == ((8192, 3), (32, 128, 128))
    assert spec.state_bytes == 8192 * 3 * 2 + 32 * 128 * 128 * 2 == 1097728
    assert spec.mamba_type == "gdn_attention"


def test_page_unification_as_vllm() -> None:
    fa = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128)
    attn, state = unify_hybrid(fa, _granite_state(), alignment=16)
    # 806400 B of state / 2048 B per token -> 394 tokens -> 400 (multiple of 16)
    assert attn.block_size == 400
    assert attn.page_size_bytes == state.page_size_bytes == 400 * 2048 == 819200
    assert state.state_bytes == 806400  # padded by 12800 B
    assert preset("granite-4.0-h-tiny").block_size == 400
    assert preset("qwen3-next-80b-a3b").block_size == 544
    assert preset("nemotron-nano-9b-v2").block_size == 672


@pytest.mark.parametrize(
    ("name", "groups", "tensors", "layers"),
    [("granite-4.0-h-tiny", 10, 4, 40), ("nemotron-nano-9b-v2", 8, 4, 31),
     ("qwen3-next-80b-a3b", 4, 12, 48)],
)
def test_state_presets_group_as_vllm(name: str, groups: int, tensors: int, layers: int) -> None:
    lay = preset(name, num_blocks=4)
    assert (lay.num_groups, lay.num_tensors, lay.num_layers) == (groups, tensors, layers)
    assert lay.has_state and lay.cache_layout is CacheLayout.PACKED
    states = [g for g in lay.groups if isinstance(g.spec, MambaSpec)]
    assert len(states) == groups - 1
    # every group holds one state slot; the attention group one block per 400+ tokens
    blocks = request_blocks(lay, 8000)
    assert [b for g, b in zip(lay.groups, blocks, strict=True) if g in states] == [1] * (groups - 1)
    assert memory_report(lay)["host_bytes"] == lay.pool_bytes == 4 * tensors * lay.page_size_bytes


def test_bad_state_specs_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="one dtype per state shape, got 2 shapes and 1"):
        MambaSpec(block_size=8, shapes=((4, 3), (2, 2)), dtypes=("float32",))
    with pytest.raises(ValueError, match=r"dtypes must be in .* got 'fp7'"):
        MambaSpec(block_size=8, shapes=((4, 3),), dtypes=("fp7",))
    with pytest.raises(ValueError, match="positive ints, got \\(4, 0\\)"):
        MambaSpec(block_size=8, shapes=((4, 0),), dtypes=("float32",))
    with pytest.raises(ValueError, match="page_size_padded 10 is smaller than the states"):
        MambaSpec(block_size=8, shapes=((4, 3),), dtypes=("float32",), page_size_padded=10)
    with pytest.raises(ValueError, match="mamba_type must be one of"):
        MambaSpec(block_size=8, shapes=((4, 3),), dtypes=("float32",), mamba_type="rwkv")
    with pytest.raises(TypeError, match="kvstage does not handle str layers"):
        KVGroup(group_id=0, layer_names=("a",), spec="mamba")  # type: ignore[arg-type]


def test_mixed_dtype_hybrid_is_byte_addressed_and_packed_only() -> None:
    lay = synthetic_hybrid_layout(num_attention=1, num_state=3, num_blocks=8)
    assert lay.storage_dtype == "uint8"  # bf16 attention, fp32 ssm state
    assert lay.plane_elems == lay.page_size_bytes
    with pytest.raises(ValueError, match="KV_SPLIT needs K and V planes in every group"):
        KVLayout(num_blocks=8, groups=lay.groups, cache_layout=CacheLayout.KV_SPLIT)
    state = lay.groups[0].spec
    assert isinstance(state, MambaSpec)
    too_big = state.padded_to(lay.page_size_bytes + 2)
    with pytest.raises(ValueError, match="group 1 has page .* group 0 has"):
        KVLayout(num_blocks=8, groups=(
            KVGroup(group_id=0, layer_names=("a",), spec=too_big),
            KVGroup(group_id=1, layer_names=("b",), spec=lay.groups[-1].spec)))
    # per-layer views: a state layer is its raw page per block (bytes: its states have two
    # dtypes), an attention layer its bf16 [num_blocks, 2, block, heads, head]
    views = KVCache(lay).layer_caches()
    state_view = views[lay.groups[0].layer_names[0]]
    assert (state_view.dtype, state_view.shape) == (torch.uint8, (8, lay.page_size_bytes))
    attn = lay.groups[-1]
    assert views[attn.layer_names[0]].dtype == torch.bfloat16
    assert views[attn.layer_names[0]].shape == (8, 2, attn.spec.block_size, 1, 8)


def test_exchange_keeps_the_running_state_slot() -> None:
    spec = MambaSpec(block_size=64, shapes=((8, 3),), dtypes=("float32",),
                     num_speculative_blocks=2, page_size_padded=96)
    fa = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=12, dtype="float32")
    lay = KVLayout(num_blocks=32, groups=(
        KVGroup(group_id=0, layer_names=("s",), spec=spec),
        KVGroup(group_id=1, layer_names=("a",), spec=fa)))
    # [null, running, scratch, scratch] -> the running slot, as vLLM's clip_ssm
    assert clip_to_window([[0, 5, 6, 7], [1, 2, 3]], lay) == [[5], [1, 2, 3]]
    assert clip_to_window([[9], []], lay) == [[9], []]
    assert clip_to_window([[], []], lay) == [[], []]


def test_codec_round_trips_state_groups() -> None:
    lay = preset("qwen3-next-80b-a3b", num_blocks=16)
    back = layout_from_msg(layout_to_msg(lay))
    assert back == lay
    lay.check_compatible(back)
    other = preset("granite-4.0-h-tiny", num_blocks=16)
    with pytest.raises(ValueError, match="incompatible KV layout"):
        lay.check_compatible(other)


VARIANTS = [(name, hl, mode) for name in STATE_PRESETS for hl in HostLayout
            for mode in ("direct", "staged")]


@pytest.mark.parametrize("direction", [Direction.D2H, Direction.H2D], ids=lambda d: d.value)
@pytest.mark.parametrize(("name", "host_layout", "mode"), VARIANTS,
                         ids=[f"{n}-{h.value}-{m}" for n, h, m in VARIANTS])
def test_state_presets_byte_exact(
    name: str, host_layout: HostLayout, mode: str, direction: Direction
) -> None:
    """A request of a state hybrid: one state slot per state group, a run of attention
    blocks, null padding; copied exactly, nothing else touched, one op per run."""
    lay = preset(name, num_blocks=8)
    cache, host = make_pair(KVCache(lay), HostBuffer(lay, host_layout), seed=5)
    states = [g.group_id for g in lay.groups if isinstance(g.spec, MambaSpec)]
    # state slots 1, 3, 4 and attention blocks 5, 6, 7: runs cross groups ([1], [3..7])
    slots = iter([1, 3, 4, 2])
    groups = [[next(slots)] if g in states[:3] else [] for g in range(lay.num_groups)]
    groups[-1] = [0, 5, 6, 7]
    flat = [b for g in groups for b in g]
    src, dst = (cache, host) if direction is Direction.D2H else (host, cache)
    src_before, dst_before = as_bytes(src.canonical), as_bytes(dst.canonical)
    engine = CopyEngine(cache, host, mode=mode,  # type: ignore[arg-type]
                        max_temp_bytes=2 * (lay.block_bytes + INDEX_BYTES))
    with OpCounter() as ops:
        stats = engine.copy(groups, direction)
    check_invariants(src_before=src_before, src_after=as_bytes(src.canonical),
                     dst_before=dst_before, dst_after=as_bytes(dst.canonical), ids=flat,
                     null_may_change=False)
    assert stats.blocks == 6
    assert stats.nbytes == 6 * lay.block_bytes == 6 * lay.num_tensors * lay.page_size_bytes
    plan = plan_copy(lay, GroupedBlockIds(groups, lay))
    assert plan.num_runs == 2
    if mode == "direct":
        assert ops.counts.get("copy_", 0) == plan.num_runs  # one op per run, all tensors


def test_host_bytes_equal_device_pool_for_state_presets() -> None:
    for name in STATE_PRESETS:
        lay = preset(name, num_blocks=3)
        host = HostBuffer(lay)
        assert host.nbytes == KVCache(lay).nbytes == lay.pool_bytes
