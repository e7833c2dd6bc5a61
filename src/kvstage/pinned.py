"""Page-locked host memory of exactly the size asked for.

Why: PyTorch's pinned allocator (``torch.empty(..., pin_memory=True)``) takes its blocks from
a caching host allocator that rounds every request up to the next power of two, so a 3 GiB
staging buffer locks 4 GiB and a 60 GiB host budget becomes 64 (vLLM issue 46278 saw 60 GB
become 80 GB across its per-layer buffers). kvstage's host buffer is as large as the
device's KV pool by design, so it is allocated as ordinary (pageable) memory of the exact
size, its pages touched once, then page-locked in place with ``cudaHostRegister``: what is
locked is what was asked for, and ``is_pinned()`` holds, so copies to and from the device
are DMA and may be non-blocking.

Contract
--------
- `pinned_bytes(nbytes)`: a 1-D ``uint8`` CPU tensor of exactly ``nbytes`` bytes, zeroed,
  page-locked. Views of it share its memory; the pages are unregistered when the last
  tensor viewing them is freed (a finalizer on the owning numpy array, which every view's
  storage keeps alive). Needs CUDA: ValueError in one line otherwise.
- `caching_pinned_bytes(nbytes)`: what PyTorch's caching host allocator reserves for a
  request of ``nbytes`` (the next power of two), for reports and checks.
- `live_pinned_bytes()`: the bytes of this process's `pinned_bytes` allocations alive.

CUDA is reached only through ``torch.cuda`` inside these functions: importing this module
never initializes CUDA. Thread rules: none (no state besides the finalizers).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

#: cudaHostRegisterPortable: the pages count as pinned for every CUDA context.
_PORTABLE = 1


def caching_pinned_bytes(nbytes: int) -> int:
    """The block PyTorch's caching host allocator reserves for ``nbytes`` (power of two)."""
    return 1 << max(0, (nbytes - 1).bit_length())


#: address -> bytes of every page-locked allocation of this process still alive
_LIVE: dict[int, int] = {}


def live_pinned_bytes() -> int:
    """Bytes kvstage holds page-locked right now (`pinned_bytes` allocations alive)."""
    return sum(_LIVE.values())


def _unregister(ptr: int) -> None:
    _LIVE.pop(ptr, None)
    # at interpreter exit CUDA may already be unloading: nothing is left to release then
    if torch.cuda.is_initialized():
        torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed, page-locked host bytes as a ``uint8`` tensor (see the module doc)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"pinned_bytes expects a byte count >= 1, got {nbytes!r}")
    if not torch.cuda.is_available():
        raise ValueError("page-locked host memory needs CUDA, and torch sees no CUDA device; "
                         "use pageable memory (pin_memory=False) on this machine")
    array = np.zeros(nbytes, dtype=np.uint8)
    array.fill(0)  # np.zeros maps lazily: fault every page in before it is locked
    ptr = int(array.ctypes.data)
    torch.cuda.init()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} host bytes failed with CUDA error "
                           f"{err}; check the locked-memory limit (ulimit -l) and free RAM")
    _LIVE[ptr] = nbytes
    weakref.finalize(array, _unregister, ptr)
    return torch.from_numpy(array)
