"""`kvstage.pinned`: page-locked host memory of exactly the size asked for.

CPU: the refusals and the allocator arithmetic. GPU (``-m gpu``, in scripts/gpu_check.sh):
the bytes are exactly the request, pinned, untouched by PyTorch's caching host allocator,
copy to and from the device exactly, and are unregistered when the last view goes. The
vLLM connector's host buffer (``HostBuffer.for_device`` of the cache `wrap_vllm_caches`
makes of vLLM's tensors) is the device pool's bytes, pinned exactly on CUDA (CPU too: not
pinned, same bytes).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch

from kvstage import HostBuffer
from kvstage.engine import CopyEngine
from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.pinned import caching_pinned_bytes, live_pinned_bytes, pinned_bytes
from kvstage.presets import preset

GIB = 1 << 30


def test_caching_allocator_rounds_to_powers_of_two() -> None:
    assert caching_pinned_bytes(1) == 1
    assert caching_pinned_bytes(4096) == 4096
    assert caching_pinned_bytes(4097) == 8192
    assert caching_pinned_bytes(3 * GIB) == 4 * GIB  # what exact pinning saves: 1 GiB
    assert caching_pinned_bytes(60 * GIB) == 64 * GIB


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8"])
def test_refuses_non_counts(bad: object) -> None:
    with pytest.raises(ValueError, match="expects a byte count >= 1"):
        pinned_bytes(bad)  # type: ignore[arg-type]


def test_refuses_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="needs CUDA"):
        pinned_bytes(4096)


def _host_allocated() -> int:
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0))


@pytest.mark.gpu
def test_exact_pinned_bytes_on_cuda() -> None:
    n = 3 * (1 << 20) + 4096  # not a power of two: torch's allocator would lock 4 MiB
    before = _host_allocated()
    host = pinned_bytes(n)
    assert host.numel() == host.untyped_storage().nbytes() == n
    assert host.is_pinned()
    assert _host_allocated() == before  # the caching host allocator was not used
    src = torch.arange(n, dtype=torch.int64).remainder(251).to(torch.uint8)
    host.copy_(src)
    dev = host.to("cuda", non_blocking=True)
    back = pinned_bytes(n)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    live = live_pinned_bytes()
    assert live >= 2 * n
    view = host[4096:]
    del host
    gc.collect()
    assert view.is_pinned() and live_pinned_bytes() == live  # a view keeps the pages
    del view, back
    gc.collect()
    assert live_pinned_bytes() == live - 2 * n  # unregistered when the last view went


@pytest.mark.gpu
def test_host_buffers_equal_the_device_pool_on_cuda() -> None:
    layout = preset("gemma-3-1b", num_blocks=37)  # 6 groups on 5 tensors, 37 blocks
    before = _host_allocated()
    buf = HostBuffer.for_device(layout, "cuda")
    assert buf.pinned and buf.storage.is_pinned()
    assert buf.storage.untyped_storage().nbytes() == layout.pool_bytes
    assert _host_allocated() == before


@dataclass(frozen=True)
class FullAttentionSpec:  # vLLM's class name; the attributes the connector reads
    num_kv_heads: int = 2
    head_size: int = 64


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_connector_host_buffer_is_the_device_pool(device: str) -> None:
    """vLLM 0.32.0's tensors (one int8 buffer; a second group's layer aliases layer0) ->
    the connector's host buffer: the buffer's bytes once, not per layer name (4 x 37
    pages), pinned exactly when the device is CUDA."""
    num_blocks, page = 37, 2 * 16 * 2 * 64 * 2  # [37, 2 heads, 16 tokens, 2 x 64] fp16
    backing = torch.zeros(3 * num_blocks * page, dtype=torch.int8, device=device)
    layers = {f"layer{i}": backing[i * num_blocks * page : (i + 1) * num_blocks * page]
              .view(torch.float16).view(num_blocks, 2, 16, 128) for i in range(3)}
    layers["alias"] = layers["layer0"]  # one storage, two names (two groups): one tensor
    groups = [(["layer0", "layer1", "layer2"], FullAttentionSpec()),
              (["alias"], FullAttentionSpec())]
    cuda = device == "cuda"
    before = _host_allocated() if cuda else 0
    cache = wrap_vllm_caches(layers, groups, num_blocks, "test")
    host = HostBuffer.for_device(cache.layout, cache.device)
    assert cache.layout.num_tensors == 3 and cache.layout.num_groups == 2
    assert host.block_major
    assert host.nbytes == cache.nbytes == backing.untyped_storage().nbytes() \
        == 3 * num_blocks * page
    assert host.pinned == host.storage.is_pinned() == cuda
    CopyEngine(cache, host)  # on CUDA it refuses an unpinned host buffer
    if cuda:
        assert _host_allocated() == before  # pinned exactly, not through torch's cache
