"""The connector's state-group pieces, on tensors shaped exactly as vLLM 0.32.0 hands them
(scripts/probe_hybrid_kv.py on the tiny Granite: one int8 backing buffer; an attention layer
``[num_blocks, 1, block, 2 x head]`` float32 and a Mamba layer ``[num_blocks, 1, 1, state
bytes]`` int8 whose block stride is the padded page, both at offset 0): torch only, vLLM's
spec objects stood in by classes of the same names and attributes.

- The connector's copies (`copies.wrap_vllm_caches`, its block-major
  ``HostBuffer.for_device``, kvstage's `CopyEngine`) move whole logical pages (state
  padding included) of every physical tensor for the ids given, and nothing else; with
  attention split into kernel blocks (r = 2) the same logical rows.
- `copies.unsupported` / `kvstage_groups` refuse other specs in one line naming the model;
  `wrap_vllm_caches` a state layout that is not one dense page per block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest
import torch

from kvstage.cache import HostBuffer
from kvstage.engine import CopyEngine, Direction
from kvstage.integrations.vllm.copies import (
    kvstage_groups,
    unsupported,
    wrap_vllm_caches,
)
from kvstage.layout import FullAttentionSpec as KSFull
from kvstage.layout import MambaSpec as KSMamba
from kvstage.plan import runs_of_ids

NUM_BLOCKS, PAGE = 8, 1024  # bytes per logical block
STATE_BYTES = 3 * 40 * 4 + 2 * 4 * 4 * 4  # conv (40, 3) fp32 + ssm (2, 4, 4) fp32 = 736


class MambaType(enum.Enum):
    MAMBA2 = "mamba2"
    KDA = "kda"


@dataclass(frozen=True)
class MambaSpec:  # vLLM's name; the attributes kvstage reads
    block_size: int
    shapes: tuple[tuple[int, ...], ...] = ((40, 3), (2, 4, 4))
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float32)
    mamba_type: MambaType = MambaType.MAMBA2
    num_speculative_blocks: int = 0


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int = 1
    head_size: int = 16
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class CrossAttentionSpec(FullAttentionSpec):
    pass


def vllm_like_caches(ratio: int = 1) -> dict[str, torch.Tensor]:
    """One int8 buffer; 'mamba.0' and 'attn.0' alias it (two groups, one physical
    tensor); the attention layer in kernel blocks of PAGE / ratio."""
    buf = torch.randint(-128, 127, (NUM_BLOCKS * PAGE,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(3))
    mamba = buf.as_strided((NUM_BLOCKS, 1, 1, STATE_BYTES), (PAGE, STATE_BYTES, STATE_BYTES, 1))
    rows = PAGE // 4 // 32 // ratio  # float32 rows of 2 x 16 per kernel block
    attn = buf.view(torch.float32).as_strided(
        (NUM_BLOCKS * ratio, 1, rows, 32), (PAGE // 4 // ratio, PAGE // 4 // ratio, 32, 1))
    return {"mamba.0": mamba, "attn.0": attn}


def groups_of(block_size: int = 8) -> list[tuple[list[str], object]]:
    return [(["mamba.0"], MambaSpec(block_size=512)),
            (["attn.0"], FullAttentionSpec(block_size=block_size))]


def raw(t: torch.Tensor) -> torch.Tensor:
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage).clone()


@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_whole_logical_pages_of_every_group(ratio: int, direction: str) -> None:
    device = vllm_like_caches(ratio)
    groups = kvstage_groups(groups_of(), device, NUM_BLOCKS, "tiny-granite")
    assert isinstance(groups[0][1], KSMamba) and isinstance(groups[1][1], KSFull)
    assert groups[0][1].page_size_bytes == PAGE and groups[0][1].state_bytes == STATE_BYTES
    assert groups[1][1].block_size == 8  # logical: PAGE / (2 x 16 x 4 B)
    cache = wrap_vllm_caches(device, groups_of(), NUM_BLOCKS, "tiny-granite")
    host = HostBuffer.for_device(cache.layout, cache.device)
    engine = CopyEngine(cache, host)
    # both groups on one physical tensor: a host row is one logical page, padding included
    assert cache.layout.num_tensors == 1 and cache.layout.block_bytes == PAGE
    assert host.block_major and host.nbytes == NUM_BLOCKS * PAGE
    device_raw = torch.empty(0, dtype=torch.uint8).set_(device["mamba.0"].untyped_storage())
    host_raw = host.storage.view(NUM_BLOCKS, -1).view(torch.uint8).view(-1)
    host_raw.copy_(torch.randint(0, 255, (NUM_BLOCKS * PAGE,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(9)))
    src, dst = (device_raw, host_raw) if direction == "d2h" else (host_raw, device_raw)
    before_src, before_dst = src.clone(), dst.clone()
    # a request: state slot 5 (mamba group), attention blocks 2, 3: the scheduler's
    # logical ids, one list per group as the worker saves them (whatever the kernel split
    # r); the decode loads the runs of the same ids
    ids = [[5], [2, 3]]
    if direction == "d2h":
        engine.save_to_host(ids)
    else:
        engine.copy_runs(runs_of_ids([b for g in ids for b in g]), Direction.H2D)
    assert torch.equal(src, before_src)
    for b in range(NUM_BLOCKS):
        page = slice(b * PAGE, (b + 1) * PAGE)
        want = before_src[page] if b in (2, 3, 5) else before_dst[page]
        assert torch.equal(dst[page], want), b  # padding of slot 5 included


def test_other_specs_refused_in_one_line() -> None:
    why = unsupported(CrossAttentionSpec(block_size=8), "ibm/tiny")
    assert why is not None and "\n" not in why
    assert why.startswith("kvstage does not handle CrossAttentionSpec layers (ibm/tiny); ")
    assert "MambaSpec (MAMBA1, MAMBA2, GDN_ATTN, SHORT_CONV, LINEAR)" in why
    kda = unsupported(MambaSpec(block_size=8, mamba_type=MambaType.KDA), "m")
    assert kda is not None and "MambaSpec(KDA) layers (m)" in kda
    assert unsupported(MambaSpec(block_size=8), "m") is None
    device = vllm_like_caches()
    with pytest.raises(ValueError, match=r"does not handle CrossAttentionSpec layers \(x\)"):
        kvstage_groups([(["attn.0"], CrossAttentionSpec(block_size=8))], device, NUM_BLOCKS, "x")


def test_mamba_layout_not_dense_refused() -> None:
    """A state view whose reach passes its block stride is not one page per block."""
    device = vllm_like_caches()
    bad = dict(device)
    bad["mamba.0"] = device["mamba.0"].as_strided(
        (NUM_BLOCKS // 2, 1, 1, PAGE + 8), (PAGE, PAGE + 8, PAGE + 8, 1))
    groups = [(["mamba.0"], MambaSpec(block_size=8))]
    kvstage_groups(groups, bad, NUM_BLOCKS // 2)  # the spec is one kvstage copies ...
    with pytest.raises(ValueError, match="not \\[num_blocks, ...\\] with each block one dense"):
        wrap_vllm_caches(bad, groups, NUM_BLOCKS // 2, "tiny-granite")  # ... not its layout


def test_group_shards_from_a_ranks_specs() -> None:
    """A rank's specs count its heads and state units: the global count is that times the
    TP size, or the model's total where one head per rank is a replica."""
    from kvstage.integrations.vllm.tp import group_shards
    from kvstage.pd.tp_map import AttentionShards, StateShards

    cache = wrap_vllm_caches(vllm_like_caches(), groups_of(), NUM_BLOCKS, "tiny-granite")
    # the Mamba2 state (conv (40, 3), ssm (2, 4, 4)): x 2 heads of 4 rows, B and C 4 groups
    # of 4 rows each (40 = 8 + 2 x 16), 2 SSM heads; attention 1 KV head per rank
    state = StateShards(fields=(("x", 4), ("B", 8), ("C", 8), ("ssm_heads", 4)))
    assert group_shards(cache.layout, 2, 4) == [state, AttentionShards(num_kv_heads=2)]
    assert group_shards(cache.layout, 2, 1)[1] == AttentionShards(num_kv_heads=1)  # replicas
