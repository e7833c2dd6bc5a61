"""Op counting and temporary-memory accounting, shared by the tests and the benchmark.

`OpCounter` is a TorchDispatchMode: it sees every aten op the engine issues, so a test
can assert "one copy op per run" exactly. It also tracks the bytes of every fresh
tensor an op allocates while it is alive, giving the peak temporary bytes of a copy on
any device (on CUDA the benchmark cross-checks with torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# aten ops that move KV bytes (or upload an index for a gather), as a TorchDispatchMode
# sees them: only ops that reach the Python dispatch key, so no composite names
# (``contiguous`` arrives as ``clone``, ``x[i] = v`` as ``index_put_``) and no kernel
# internals (``_index_put_impl_``, ``_copy_from``). tests/core/test_opcount.py checks that
# a real call produces every name here.
DATA_OPS = frozenset(
    {
        "copy_",
        "_to_copy",
        "index",
        "index_put_",
        "index_select",
        "index_copy_",
        "index_copy",
        "gather",
        "scatter_",
        "clone",
    }
)


class OpCounter(TorchDispatchMode):
    """Counts aten ops and live temporary bytes while active.

    ``counts``: op name (overload packet, e.g. ``copy_``) -> calls.
    ``peak_temp_bytes``: largest sum of bytes of op-allocated tensors alive at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.live_bytes = 0
        self.peak_temp_bytes = 0
        self.total_alloc_bytes = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        inputs, _ = tree_flatten((args, kwargs))
        seen = {
            t.untyped_storage().data_ptr()
            for t in inputs
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        out = func(*args, **kwargs)
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or ptr == 0:
                continue  # in-place or a view of an input: nothing new allocated
            seen.add(ptr)
            self._track(t, t.untyped_storage().nbytes())
        return out

    def _track(self, t: torch.Tensor, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.total_alloc_bytes += nbytes
        self.peak_temp_bytes = max(self.peak_temp_bytes, self.live_bytes)
        weakref.finalize(t, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    @property
    def data_ops(self) -> int:
        """Calls of ops that move bytes (copies, gathers, scatters, transfers)."""
        return sum(n for k, n in self.counts.items() if k in DATA_OPS)

    def data_counts(self) -> dict[str, int]:
        return {k: n for k, n in sorted(self.counts.items()) if k in DATA_OPS}
