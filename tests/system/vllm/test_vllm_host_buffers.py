"""The connector's host buffers and copy, on tensors laid out as vLLM 0.32.0 lays them out.

Torch only (runs in the main venv too): one int8 backing buffer, every KV cache group's layer
a ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view of it from byte 0, so the
layers at one position of every group alias (gemma-3-1b: 26 layer names, 6 groups).
"""

from __future__ import annotations

import pytest
import torch

from kvstage.integrations.vllm.host_buffers import (
    BlockCopier,
    find_runs,
    host_nbytes,
    mirror_host_buffers,
)

NUM_BLOCKS, HEADS, BLOCK, HEAD = 12, 2, 4, 8


def _device_caches(num_groups: int, layers_per_group: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32.0's allocate_kv_cache: groups overlay one buffer, layer i at slot i."""
    page = HEADS * BLOCK * 2 * HEAD * 4  # float32
    buf = torch.zeros(layers_per_group * NUM_BLOCKS * page, dtype=torch.int8)
    caches = {}
    for g in range(num_groups):
        for i in range(layers_per_group):
            flat = buf[i * NUM_BLOCKS * page : (i + 1) * NUM_BLOCKS * page]
            caches[f"layers.{g * layers_per_group + i}"] = flat.view(torch.float32).view(
                NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD
            )
    return caches


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
    host["layers.0"][3].fill_(7.0)
    assert torch.equal(host["layers.4"][3], host["layers.0"][3])
    assert not torch.equal(host["layers.1"][3], host["layers.0"][3])


def test_round_trip_copies_only_the_given_blocks() -> None:
    device = _device_caches(num_groups=3, layers_per_group=2)
    for t in device.values():
        t.copy_(torch.randn_like(t))
    host = mirror_host_buffers(device)
    copier = BlockCopier(device, host)
    assert len(copier.layer_names) == 2  # one per distinct view, not one per layer name
    ids = [0, 5, 6, 7, 2, 0, 0]  # groups concatenated, null block 0 repeated
    copier(device, host, ids, ids, "d2h")
    for name in device:
        assert torch.equal(host[name][[2, 5, 6, 7]], device[name][[2, 5, 6, 7]])
        assert not host[name][[1, 3, 4]].any()  # untouched blocks stay zero
    before = {n: t.clone() for n, t in device.items()}
    for t in device.values():
        t.zero_()
    copier(host, device, ids, ids, "h2d")
    for name in device:
        assert torch.equal(device[name][[2, 5, 6, 7]], before[name][[2, 5, 6, 7]])
        assert not device[name][[1, 3, 4]].any()


def test_find_runs_and_refusals() -> None:
    assert find_runs([4, 5, 6, 9, 0, 0], [4, 5, 6, 9, 0, 0]) == [(0, 0, 1), (4, 4, 3), (9, 9, 1)]
    with pytest.raises(ValueError, match="two different sources"):
        find_runs([1, 2], [3, 3])
    with pytest.raises(ValueError, match="pair up"):
        find_runs([1, 2], [1])
    device = _device_caches(num_groups=2, layers_per_group=1)
    host = mirror_host_buffers(device)
    with pytest.raises(ValueError, match="out of range"):
        BlockCopier(device, host)(device, host, [NUM_BLOCKS], [NUM_BLOCKS], "d2h")
