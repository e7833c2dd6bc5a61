"""The connector's host buffers and copy op, on tensors laid out as vLLM 0.32.0 lays them out.

Torch only (runs in the main venv too; the vLLM-spec test needs vLLM): one int8 backing
buffer, every KV cache group's layer a ``[num_blocks, num_kv_heads, block_size, 2 *
head_size]`` view of it at its position's offset, so the layers at one position of every
group alias (vLLM's allocate_kv_cache). The op (`copies.EngineCopyOp`, kvstage's CopyEngine)
must give the bytes of vLLM's per-layer-name loop (``dst[name][ids] = src[name][ids]`` for
every name: what the connector's earlier per-view copier gave too) on the whole buffer,
touched blocks and untouched ones, except the null block 0 which kvstage never copies,
with no more copy ops than that copier's one per distinct view per run.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvstage.integrations.vllm.copies import EngineCopyOp, kvstage_groups
from kvstage.integrations.vllm.host_buffers import host_nbytes, mirror_host_buffers
from kvstage.testing.opcount import DATA_OPS, OpCounter

NUM_BLOCKS, HEADS, BLOCK, HEAD = 12, 2, 4, 8


# stand-ins for vLLM's spec classes: the connector maps them by class name and attributes
@dataclass(frozen=True)
class FullAttentionSpec:
    num_kv_heads: int
    head_size: int
    block_size: int


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int


def _device_caches(
    num_groups: int, layers_per_group: int, *, permuted: bool = False, gap: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """vLLM 0.32.0's allocate_kv_cache: groups overlay one buffer, layer i at slot i.

    ``permuted``: vLLM's LBNHC (allocated ``[NB, BS, H, 2D]``, viewed ``[NB, H, BS, 2D]``);
    ``gap``: pages of padding after tensor 0 (no longer evenly spaced: no slab).
    """
    elem = dtype.itemsize
    page = HEADS * BLOCK * 2 * HEAD * elem
    size = NUM_BLOCKS * page
    offsets = [i * size + (gap * page if i else 0) for i in range(layers_per_group)]
    buf = torch.randint(-128, 128, (offsets[-1] + size,), dtype=torch.int8)
    caches = {}
    for g in range(num_groups):
        for i in range(layers_per_group):
            flat = buf[offsets[i] : offsets[i] + size].view(dtype)
            if permuted:
                t = flat.view(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD).permute(0, 2, 1, 3)
            else:
                t = flat.view(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
            caches[f"model.layers.{g * layers_per_group + i}.self_attn.attn"] = t
    return caches


def _vllm_groups(num_groups: int, layers_per_group: int) -> list[tuple[list[str], object]]:
    """(layer names, a spec with vLLM's attribute names): group 0 full, the rest sliding."""
    out: list[tuple[list[str], object]] = []
    for g in range(num_groups):
        names = [f"model.layers.{g * layers_per_group + i}.self_attn.attn"
                 for i in range(layers_per_group)]
        spec = (FullAttentionSpec(num_kv_heads=HEADS, head_size=HEAD, block_size=BLOCK)
                if g == 0 else SlidingWindowSpec(num_kv_heads=HEADS, head_size=HEAD,
                                                 block_size=BLOCK, sliding_window=2 * BLOCK))
        out.append((names, spec))
    return out


def _op(device: dict[str, torch.Tensor], host: dict[str, torch.Tensor], groups: int,
        per_group: int) -> EngineCopyOp:
    return EngineCopyOp(device, host, kvstage_groups(_vllm_groups(groups, per_group), device))


def _reference(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
               ids: list[int]) -> None:
    """vLLM's per-layer-name loop (copy_kv_blocks' semantics) over the non-null ids: the
    null block 0 (sliding-window padding, never read as KV) is the one difference, kvstage
    leaves it alone on the destination (the earlier copier copied it)."""
    idx = torch.tensor([i for i in ids if i != 0], dtype=torch.int64)
    for name in src:
        dst[name][idx] = src[name][idx]


def _raw(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every distinct storage as a uint8 tensor sharing its memory (aliases once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in caches.values():
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen[s.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
    return list(seen.values())


def _bytes(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [r.clone() for r in _raw(caches)]


def _copy_ops(fn: object, *args: object) -> dict[str, int]:
    with OpCounter() as counter:
        fn(*args)  # type: ignore[operator]
    return {k: v for k, v in counter.counts.items() if k in DATA_OPS}


def test_host_aliases_like_device_and_costs_one_pool() -> None:
    device = _device_caches(num_groups=3, layers_per_group=2)
    host = mirror_host_buffers(device)
    assert host.keys() == device.keys()
    assert host_nbytes(host) == host_nbytes(device)  # not 3x, as per-layer buffers are
    for name, d in device.items():
        h = host[name]
        assert (h.shape, h.stride(), h.storage_offset()) == (
            d.shape, d.stride(), d.storage_offset()
        )
    # layers 0, 2, 4 alias on the device, so they do on the host
    host["model.layers.0.self_attn.attn"][3].fill_(7.0)
    assert torch.equal(host["model.layers.4.self_attn.attn"][3],
                       host["model.layers.0.self_attn.attn"][3])
    assert not torch.equal(host["model.layers.1.self_attn.attn"][3],
                           host["model.layers.0.self_attn.attn"][3])


@pytest.mark.parametrize(
    ("permuted", "gap", "dtype"),
    [(False, 0, torch.float32), (True, 0, torch.bfloat16), (False, 3, torch.float16)],
    ids=["lbhnc-slab", "lbnhc-slab-bf16", "spaced-no-slab"],
)
@pytest.mark.parametrize(
    "ids",
    [[0, 5, 6, 7, 2, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 3, 0, 10, 1, 0, 7, 4]],
    ids=["null-padded", "one-run", "scattered"],
)
def test_round_trip_bytes_equal_vllm_loop_with_fewer_ops(
    permuted: bool, gap: int, dtype: torch.dtype, ids: list[int]
) -> None:
    groups, per_group = 3, 3 if gap else 2  # a gap unevens the spacing of 3 tensors
    device = _device_caches(groups, per_group, permuted=permuted, gap=gap, dtype=dtype)
    host = mirror_host_buffers(device)
    for raw in _raw(host):  # other random bytes on the host: untouched ones must stay
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    op = _op(device, host, groups, per_group)
    slab = op.engine.cache.canonical is not None
    assert slab == (gap == 0)

    real = sorted(set(ids) - {0})
    runs = sum(1 for i, b in enumerate(real) if i == 0 or real[i - 1] != b - 1)
    views = per_group  # the old copier's distinct views per run: one per physical tensor
    want_ops = runs if slab else runs * views

    ref_host = mirror_host_buffers(device)
    for r, h in zip(_raw(ref_host), _raw(host), strict=True):
        r.copy_(h)
    _reference(device, ref_host, ids)
    dev_before = _bytes(device)
    assert _copy_ops(op, device, host, ids, list(ids), "d2h") == {"copy_": want_ops}
    assert want_ops <= runs * views
    for got, want in zip(_raw(host), _raw(ref_host), strict=True):
        assert torch.equal(got, want)
    for got, want in zip(_raw(device), dev_before, strict=True):
        assert torch.equal(got, want)  # the source is unchanged

    # h2d into a device whose blocks were overwritten: the saved blocks come back, the
    # others keep the new bytes
    for raw in _raw(device):
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    ref_dev = mirror_host_buffers(device)
    for r, d in zip(_raw(ref_dev), _raw(device), strict=True):
        r.copy_(d)
    _reference(host, ref_dev, ids)
    assert _copy_ops(op, host, device, ids, ids, "h2d") == {"copy_": want_ops}
    for got, want in zip(_raw(device), _raw(ref_dev), strict=True):
        assert torch.equal(got, want)
    moved = torch.tensor(real)
    for name in device:
        assert torch.equal(device[name][moved].view(torch.uint8),
                           host[name][moved].view(torch.uint8))
