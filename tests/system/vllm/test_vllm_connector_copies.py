"""The connector's host buffer and copies, on tensors laid out as vLLM 0.32.0 lays them out.

Torch only (runs in the main venv too): one int8 backing buffer, every KV cache group's
layer a ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view of it at its
position's offset, so the layers at one position of every group alias (vLLM's
allocate_kv_cache). The connector wraps them (`copies.wrap_vllm_caches`), gives them the
block-major ``HostBuffer.for_device`` and copies with kvstage's `CopyEngine`, as
``WorkerSide.register`` and the pd/ roles do: d2h as ``PrefillWorker.save`` (one id list
per group), h2d as the decode's loader (``copy_runs`` of the request's runs). Asserted:

- host bytes equal the device pool (one row per block of every physical tensor), not
  groups x the pool as vLLM's one-buffer-per-layer-name host path allocates;
- a d2h writes each moved block's row as the device's bytes of that block, tensor after
  tensor, leaves every other row (the null block 0 included) and the device alone;
- a d2h, the device overwritten, then an h2d leave the device with the bytes vLLM's own
  per-layer-name loop (``dst[name][ids] = src[name][ids]``, what ``copy_kv_blocks`` does,
  through its per-layer host buffers) leaves, on the whole buffer, touched blocks and
  untouched ones (kvstage never copies the null block 0; vLLM's loop here skips it too);
- with fewer ops than that loop: one ``copy_`` per run when the tensors are evenly spaced
  in one buffer (a slab), one per run per physical tensor otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvstage.cache import HostBuffer
from kvstage.engine import CopyEngine, Direction
from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.plan import runs_of_ids
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


def _page(dtype: torch.dtype) -> int:
    return HEADS * BLOCK * 2 * HEAD * dtype.itemsize


def _offsets(num_tensors: int, gap: int, page: int) -> list[int]:
    """Byte offset of each physical tensor (layer position) in the backing buffer."""
    return [i * NUM_BLOCKS * page + (gap * page if i else 0) for i in range(num_tensors)]


def _device_caches(
    num_groups: int, layers_per_group: int, *, permuted: bool = False, gap: int = 0,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM 0.32.0's allocate_kv_cache: groups overlay one buffer, layer i at slot i.

    ``permuted``: vLLM's LBNHC (allocated ``[NB, BS, H, 2D]``, viewed ``[NB, H, BS, 2D]``);
    ``gap``: pages of padding after tensor 0 (no longer evenly spaced: no slab).
    Returns the backing buffer (as uint8) and ``{layer name: view}``.
    """
    page = _page(dtype)
    size = NUM_BLOCKS * page
    offsets = _offsets(layers_per_group, gap, page)
    buf = torch.randint(-128, 128, (offsets[-1] + size,), dtype=torch.int8,
                        generator=torch.Generator().manual_seed(seed))
    caches = {}
    for g in range(num_groups):
        for i in range(layers_per_group):
            flat = buf[offsets[i] : offsets[i] + size].view(dtype)
            if permuted:
                t = flat.view(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD).permute(0, 2, 1, 3)
            else:
                t = flat.view(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
            caches[f"model.layers.{g * layers_per_group + i}.self_attn.attn"] = t
    return buf.view(torch.uint8), caches


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


def _engine(device: dict[str, torch.Tensor], groups: int, per_group: int) -> CopyEngine:
    """The connector's copies over ``device`` (WorkerSide.register, pd/'s roles)."""
    cache = wrap_vllm_caches(device, _vllm_groups(groups, per_group), NUM_BLOCKS, "test")
    return CopyEngine(cache, HostBuffer.for_device(cache.layout, cache.device))


def _vllm_loop(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
               ids: list[int]) -> None:
    """vLLM's per-layer-name loop (copy_kv_blocks' semantics) over the non-null ids: the
    null block 0 (sliding-window padding, never read as KV) is left alone, as kvstage
    leaves it."""
    idx = torch.tensor([i for i in ids if i != 0], dtype=torch.int64)
    for name in src:
        dst[name][idx] = src[name][idx]


def _copy_ops(fn: object, *args: object) -> dict[str, int]:
    with OpCounter() as counter:
        fn(*args)  # type: ignore[operator]
    return {k: v for k, v in counter.counts.items() if k in DATA_OPS}


def _tensor_pages(buf: torch.Tensor, num_tensors: int, gap: int, page: int) -> torch.Tensor:
    """``[num_tensors, NUM_BLOCKS, page]`` bytes of the physical tensors in ``buf``."""
    return torch.stack([buf[s : s + NUM_BLOCKS * page].view(NUM_BLOCKS, page)
                        for s in _offsets(num_tensors, gap, page)])


def test_host_buffer_costs_one_pool() -> None:
    buf, device = _device_caches(num_groups=3, layers_per_group=2)
    engine = _engine(device, 3, 2)
    host = engine.host
    assert host.block_major and host.pinned is False  # pinned only for CUDA devices
    assert engine.layout.num_tensors == 2 and engine.layout.num_groups == 3
    assert host.nbytes == engine.cache.nbytes == buf.numel()  # the device pool, once
    per_layer_name = sum(t.nbytes for t in device.values())  # vLLM's host buffers
    assert per_layer_name == 3 * host.nbytes
    # layers 0, 2, 4 alias on the device, so they do in the host buffer's layer views
    views = host.layer_views()
    assert views["model.layers.0.self_attn.attn"].data_ptr() \
        == views["model.layers.4.self_attn.attn"].data_ptr()
    assert views["model.layers.1.self_attn.attn"].data_ptr() \
        != views["model.layers.0.self_attn.attn"].data_ptr()


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
    buf, device = _device_caches(groups, per_group, permuted=permuted, gap=gap, dtype=dtype)
    ref_buf, ref_device = _device_caches(groups, per_group, permuted=permuted, gap=gap,
                                         dtype=dtype)  # the same bytes, for vLLM's loop
    assert torch.equal(buf, ref_buf)
    engine = _engine(device, groups, per_group)
    slab = engine.cache.canonical is not None
    assert slab == (gap == 0)
    host_rows = engine.host.storage.view(NUM_BLOCKS, -1).view(torch.uint8)
    host_rows.copy_(torch.randint(0, 256, host_rows.shape, dtype=torch.uint8))
    # vLLM's host path: one buffer per layer name
    vllm_host = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in device.items()}

    real = sorted(set(ids) - {0})
    runs = sum(1 for i, b in enumerate(real) if i == 0 or real[i - 1] != b - 1)
    want_ops = runs if slab else runs * per_group  # per_group: the physical tensors
    # the scheduler's ids, one list per group (the connector saves them so)
    per = -(-len(ids) // groups)
    grouped = [ids[g * per : (g + 1) * per] for g in range(groups)]

    host_before, dev_before = host_rows.clone(), buf.clone()
    assert _copy_ops(engine.save_to_host, grouped) == {"copy_": want_ops}
    vllm_ops = _copy_ops(_vllm_loop, ref_device, vllm_host, ids)
    assert want_ops < sum(vllm_ops.values())
    assert torch.equal(buf, dev_before)  # the source is unchanged
    pages = _tensor_pages(buf, per_group, gap, _page(dtype))  # [T, NB, page]
    for b in range(NUM_BLOCKS):
        want = pages[:, b].reshape(-1) if b in real else host_before[b]
        assert torch.equal(host_rows[b], want), b  # null block 0 and the rest untouched

    # h2d into a device whose blocks were overwritten (the same bytes on both sides): the
    # saved blocks come back, the others keep the new bytes, as with vLLM's loop
    new = torch.randint(0, 256, buf.shape, dtype=torch.uint8)
    buf.copy_(new)
    ref_buf.copy_(new)
    ops = _copy_ops(engine.copy_runs, runs_of_ids(ids), Direction.H2D)
    assert ops == {"copy_": want_ops}
    _vllm_loop(vllm_host, ref_device, ids)
    assert torch.equal(buf, ref_buf)  # touched blocks and untouched ones
    assert not torch.equal(buf, new)
