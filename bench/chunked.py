"""Incremental prefill saves (`python -m bench.transfer --pipeline`, second table): how
much of a chunked prefill's d2h hides behind the compute of its later chunks.

One `PrefillWorker` in this process (loopback transport: nothing is READ), per request
size a prompt in ``CHUNKS`` uneven chunks whose boundaries fall inside blocks (cut at
20 %, 45 % and 75 % of the tokens); each chunk's blocks, the cut one again, are saved
after the chunk's "compute". The compute stand-in is a real fp32 matmul loop, calibrated
per size to take as long as that size's d2h of one chunk (the regime where overlap
matters most). Per iteration, in rotating order:

- ``compute``: the compute alone; ``d2h``: the saves alone (``wait=True``);
- ``sequential``: compute, then ``save(wait=True)``, per chunk, then ``hold``;
- ``overlapped``: compute, then ``save(wait=False)`` per chunk (the copy runs on the CPU
  save thread, or the CUDA copy stream, while the next chunk computes), then ``hold``.

``hidden %`` = (sequential - overlapped) / d2h: the share of the d2h that no longer adds
to the prefill's time. The last chunk's save has nothing after it to hide behind, so the
most that can hide is ``max %`` = 1 - (last chunk's d2h / d2h).

Alone (the saves only, no NIXL: what a GPU check can run in seconds; the vLLM connector's
saves run on the same `SaveQueue`)::

    python -m bench.chunked [--device cuda] [--preset llama-3.1-8b] [--sizes-mib 8,32,128]
                            [--iters 7] [--warmup 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch

from kvstage.bench.report import Column
from kvstage.blocks import BlockPool
from kvstage.cache import KVCache
from kvstage.layout import KVLayout
from kvstage.pd.prefill import PrefillWorker
from kvstage.transport import make_transport

CUTS = (0.20, 0.45, 0.75)  # chunk boundaries, as fractions of the prompt's tokens
MODES = ("compute", "d2h", "sequential", "overlapped")
MATMUL_N = 256
COLUMNS = [
    Column("mib", "MiB", "{:.0f}"),
    Column("chunks", "chunks"),
    Column("compute_ms", "compute ms", "{:.1f}"),
    Column("d2h_ms", "d2h ms", "{:.1f}"),
    Column("seq_ms", "sequential ms", "{:.1f}"),
    Column("ovl_ms", "overlapped ms", "{:.1f}"),
    Column("hidden_pct", "hidden %", "{:.0f}"),
    Column("max_pct", "max %", "{:.0f}"),
]


def chunk_ranges(num_blocks: int, block_size: int) -> list[tuple[int, int]]:
    """Block ranges ``[first, last)`` each chunk saves: its own tokens' blocks, the block
    the previous boundary cut included again."""
    tokens = num_blocks * block_size
    cuts = [0, *sorted({max(1, min(tokens - 1, round(tokens * c))) for c in CUTS}), tokens]
    return [(lo // block_size, -(-hi // block_size)) for lo, hi in pairwise(cuts)]


class _Compute:
    """The forward-pass stand-in: ``reps`` fp32 matmuls on the cache's device."""

    def __init__(self, device: torch.device, n: int = MATMUL_N) -> None:
        gen = torch.Generator().manual_seed(0)
        self.a = torch.randn(n, n, generator=gen).to(device)
        self.b = torch.randn(n, n, generator=gen).to(device)
        self.cuda = device.type == "cuda"
        self.reps = 1

    def __call__(self) -> None:
        out = self.a
        for _ in range(self.reps):
            out = torch.mm(out, self.b).clamp_(-1, 1)

    def calibrate(self, target_s: float) -> None:
        self.reps = 16
        secs = _median(lambda: self(), self.cuda, 5)
        self.reps = max(1, round(target_s / (secs / 16)))


def _timed(fn: Callable[[], Any], cuda: bool) -> float:
    """Seconds ``fn`` takes, its device work included."""
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _median(fn: Callable[[], Any], cuda: bool, n: int) -> float:
    return statistics.median(_timed(fn, cuda) for _ in range(n))


def measure(layout: KVLayout, sizes_blocks: dict[int, int], *, iters: int, warmup: int,
            device: str = "cpu", matmul_n: int = MATMUL_N) -> list[dict[str, Any]]:
    """One row per size (MiB -> blocks per group); see the module doc."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the save thread and the compute each get one core
    cache = KVCache(layout, device)
    cache.fill_random(1)
    rows = []
    try:
        with PrefillWorker(cache, make_transport("loopback", "bench-saves")) as prefill:
            compute = _Compute(cache.device, matmul_n)
            pool = BlockPool(layout.num_blocks)
            for mib, nblocks in sizes_blocks.items():
                ids = [pool.allocate(nblocks) for _ in range(layout.num_groups)]
                rows.append(_size(prefill, compute, mib, ids, iters, warmup))
                for g in ids:
                    pool.free(g)
    finally:
        torch.set_num_threads(threads)
    return rows


def _size(prefill: PrefillWorker, compute: _Compute, mib: int, ids: list[list[int]],
          iters: int, warmup: int) -> dict[str, Any]:
    layout, cuda = prefill.layout, compute.cuda
    ranges = chunk_ranges(len(ids[0]), layout.block_size)
    chunks = [[g[a:b] for g in ids] for a, b in ranges]
    counter = iter(range(1 << 30))

    def saves(wait: bool, with_compute: bool) -> None:
        rid = f"s{next(counter)}"
        for chunk in chunks:
            if with_compute:
                compute()
            prefill.save(rid, chunk, wait=wait)
        prefill.hold(rid)
        prefill.release(rid)

    last = _median(lambda: prefill.engine.save_to_host(chunks[-1]), cuda, 5)
    per_chunk = _median(lambda: saves(True, False), cuda, 3) / len(chunks)
    compute.calibrate(per_chunk)
    def compute_only() -> None:
        for _ in chunks:
            compute()

    runs: dict[str, Callable[[], None]] = {
        "compute": compute_only,
        "d2h": lambda: saves(True, False),
        "sequential": lambda: saves(True, True),
        "overlapped": lambda: saves(False, True),
    }
    got: dict[str, list[float]] = {k: [] for k in MODES}
    for it in range(warmup + iters):
        for j in range(len(MODES)):
            mode = MODES[(it + j) % len(MODES)]
            secs = _timed(runs[mode], cuda)
            if it >= warmup:
                got[mode].append(secs * 1e3)
    med = {k: statistics.median(v) for k, v in got.items()}
    d2h = med["d2h"]
    return {
        "mib": mib, "chunks": len(chunks), "compute_reps": compute.reps,
        "compute_ms": med["compute"], "d2h_ms": d2h, "seq_ms": med["sequential"],
        "ovl_ms": med["overlapped"],
        "hidden_pct": 100 * (med["sequential"] - med["overlapped"]) / d2h,
        "max_pct": 100 * max(0.0, 1 - last * 1e3 / d2h),
        "samples_ms": got,
    }


def main(argv: list[str] | None = None) -> int:
    from kvstage.bench.report import print_table
    from kvstage.presets import preset

    p = argparse.ArgumentParser(description="incremental prefill saves, alone")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--sizes-mib", default="8,16,32,64,128")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--matmul-n", type=int, default=MATMUL_N,
                   help="the compute stand-in's matrix size (a GPU needs ~2048 to be "
                   "bound by the matmuls, not their launches)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    try:
        sizes = sorted({int(x) for x in a.sizes_mib.split(",") if x})
    except ValueError:
        p.error(f"--sizes-mib: comma-separated integers, got {a.sizes_mib!r}")
    if (not sizes or sizes[0] < 1 or sizes[-1] > 4096 or a.iters < 1 or a.warmup < 0
            or not 16 <= a.matmul_n <= 8192):
        p.error("--sizes-mib in [1, 4096], --iters >= 1, --warmup >= 0, --matmul-n in "
                "[16, 8192]")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    probe = preset(a.preset, num_blocks=2)
    blocks = {s: max(1, (s << 20) // probe.block_bytes) for s in sizes}
    layout = preset(a.preset, num_blocks=layout_blocks(probe, blocks[sizes[-1]]))
    rows = measure(layout, blocks, iters=a.iters, warmup=a.warmup, device=a.device,
                   matmul_n=a.matmul_n)
    print_table(rows, COLUMNS, markdown=True, title="")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv, "device": a.device, "preset": a.preset,
                       "matmul_n": a.matmul_n, "rows": rows}, f, indent=1)
    return 0


def layout_blocks(probe: KVLayout, per_group: int) -> int:
    """A pool for one request of ``per_group`` blocks in every group, plus the null block."""
    return probe.num_groups * per_group + 1


if __name__ == "__main__":
    sys.exit(main())
