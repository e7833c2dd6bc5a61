"""`kvstage.pinned`: page-locked host memory of exactly the size asked for.

CPU: the refusals and the allocator arithmetic. GPU (``-m gpu``, in scripts/gpu_check.sh):
the bytes are exactly the request, pinned, untouched by PyTorch's caching host allocator,
copy to and from the device exactly, and are unregistered when the last view goes.
"""

from __future__ import annotations

import gc

import pytest
import torch

from kvstage import HostBuffer
from kvstage.integrations.vllm.host_buffers import host_nbytes, mirror_host_buffers
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
    device = {f"layer{i}": torch.zeros(2, 37, 16, 2, 64, dtype=torch.float16, device="cuda")
              for i in range(3)}
    device["alias"] = device["layer0"][:, :20]  # one storage, two names: one host allocation
    host = mirror_host_buffers(device)
    assert all(t.is_pinned() for t in host.values())
    assert host_nbytes(host) == host_nbytes(device) == 3 * 2 * 37 * 16 * 2 * 64 * 2
    assert _host_allocated() == before
