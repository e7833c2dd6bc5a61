"""Pinned host memory on CUDA: what PyTorch's pinned allocator locks vs kvstage's exact pages.

    python scripts/pinned_check.py [--gib 3.2] [--json OUT]

For a KV pool of about ``--gib`` GiB (the gemma-3-1b preset, its block count chosen to reach
that size; not a power of two), reports and asserts:
- kvstage's host buffer (`HostBuffer.for_device(layout, "cuda")`): pinned, exactly
  ``layout.pool_bytes``, and PyTorch's caching host allocator untouched (its
  ``allocated_bytes`` / ``reserved_bytes`` unchanged);
- the connector's host buffer of a device pool of about the same bytes laid out as vLLM
  0.32.0 allocates it (two KV cache groups overlaid on one int8 buffer; `connector_host`:
  `wrap_vllm_caches`, then ``HostBuffer.for_device(cache.layout, cache.device)`` as
  ``WorkerSide.register`` and the pd/ roles build it): pinned, exactly the device
  buffer's bytes, the caching allocator untouched, and a `CopyEngine` round trip of a few
  blocks byte-exact;
- for comparison, ``torch.empty(pool_bytes, pin_memory=True)``: how much resident memory
  it adds (the caching host allocator reserves the next power of two, vLLM issue 46278);
  resident memory (``VmRSS``) is read for both, as pinned pages are resident;
- each allocation's wall time (pinning is page-locking: it costs time at start-up).
Exit 1 when an assertion fails; needs CUDA (exit 2 in one line otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch

from kvstage import HostBuffer
from kvstage.cache import KVCache
from kvstage.engine import CopyEngine, Direction
from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.pinned import caching_pinned_bytes
from kvstage.plan import runs_of_ids
from kvstage.presets import preset

# gemma-3-1b's attention page as vLLM hands it: [num_blocks, 1 head, 16 tokens, 2 x 256] bf16
PAGE_SHAPE, PAGE_BYTES = (1, 16, 512), 16 * 512 * 2


@dataclass(frozen=True)
class FullAttentionSpec:  # stand-ins with vLLM's class names and the attributes read
    num_kv_heads: int = 1
    head_size: int = 256


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 512


def connector_host(nbytes: int, device: str) -> tuple[torch.Tensor, KVCache, HostBuffer]:
    """vLLM-like KV tensors of about ``nbytes`` on ``device`` (two groups of two layers
    overlaid on one int8 buffer: two physical tensors), the connector's `KVCache` of them
    and its host buffer: (the device buffer, the cache, the host buffer)."""
    num_blocks = max(2, nbytes // (2 * PAGE_BYTES))
    size = num_blocks * PAGE_BYTES
    backing = torch.zeros(2 * size, dtype=torch.int8, device=device)
    layers = {f"layers.{g * 2 + i}": backing[i * size : (i + 1) * size]
              .view(torch.bfloat16).view(num_blocks, *PAGE_SHAPE)
              for g in range(2) for i in range(2)}
    groups = [(["layers.0", "layers.1"], FullAttentionSpec()),
              (["layers.2", "layers.3"], SlidingWindowSpec())]
    cache = wrap_vllm_caches(layers, groups, num_blocks, "pinned_check")
    return backing, cache, HostBuffer.for_device(cache.layout, cache.device)


def round_trip(backing: torch.Tensor, cache: KVCache, host: HostBuffer) -> bool:
    """d2h of blocks 1..k, the device zeroed, h2d: those blocks come back, no other."""
    engine = CopyEngine(cache, host)  # refuses an unpinned host buffer on CUDA
    k = min(8, cache.layout.num_blocks - 1)
    backing.copy_(torch.randint(-128, 128, backing.shape, dtype=torch.int8,
                                generator=torch.Generator().manual_seed(1)))
    want = backing.cpu()
    runs = runs_of_ids(list(range(1, k + 1)))
    engine.copy_runs(runs, Direction.D2H)
    backing.zero_()
    engine.copy_runs(runs, Direction.H2D)
    shape = (2, cache.layout.num_blocks, PAGE_BYTES)  # [tensor, block, page]
    expect = torch.zeros(shape, dtype=torch.int8)
    expect[:, 1 : k + 1] = want.view(shape)[:, 1 : k + 1]
    return torch.equal(backing.cpu().view(shape), expect)


def host_stats() -> dict[str, int]:
    """PyTorch's caching host allocator's counters (empty where this torch keeps none)."""
    s = torch.cuda.host_memory_stats()
    return {k: int(v) for k, v in s.items() if k.endswith("bytes.all.current")
            or k.endswith("bytes.current")}


def rss_bytes() -> int:
    """This process's resident memory (pinned pages are resident), from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=3.2, help="pool size, GiB (0.01 to 64)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if not 0.01 <= a.gib <= 64:
        p.error(f"--gib must be in [0.01, 64], got {a.gib}")
    if not torch.cuda.is_available():
        print("pinned_check: needs a CUDA device (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    block_bytes = preset("gemma-3-1b", num_blocks=2).block_bytes
    layout = preset("gemma-3-1b", num_blocks=max(1, int(a.gib * (1 << 30)) // block_bytes))
    n = layout.pool_bytes
    out: dict[str, object] = {"pool_bytes": n, "num_blocks": layout.num_blocks,
                              "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    ok = True
    torch.zeros(1, device="cuda")  # the CUDA context first: its own resident memory (~100 MB)
    torch.cuda.synchronize()

    before, rss0 = host_stats(), rss_bytes()
    t0 = time.perf_counter()
    buf = HostBuffer.for_device(layout, "cuda")
    out["kvstage_s"] = time.perf_counter() - t0
    after = host_stats()
    kvstage_rss = rss_bytes() - rss0
    out["kvstage_rss_delta"] = kvstage_rss
    got = buf.storage.untyped_storage().nbytes()
    out["kvstage_bytes"], out["kvstage_pinned"] = got, buf.storage.is_pinned()
    out["kvstage_caching_delta"] = {k: after[k] - before.get(k, 0) for k in after}
    # resident: the pool's pages and no more (64 MiB of slack for the process's other use)
    ok &= got == n and buf.storage.is_pinned() and after == before \
        and abs(kvstage_rss - n) < 64 << 20
    del buf

    before = host_stats()
    t0 = time.perf_counter()
    backing, cache, host = connector_host(n, "cuda")
    torch.cuda.synchronize()
    out["connector_s"] = time.perf_counter() - t0  # the device buffer's zeroing included
    after = host_stats()
    device_bytes = backing.untyped_storage().nbytes()
    out["connector_bytes"], out["connector_device_bytes"] = host.nbytes, device_bytes
    out["connector_pinned"] = host.pinned and host.storage.is_pinned()
    out["connector_caching_delta"] = {k: after[k] - before.get(k, 0) for k in after}
    out["connector_round_trip"] = round_trip(backing, cache, host)
    ok &= host.nbytes == device_bytes == cache.nbytes and bool(out["connector_pinned"]) \
        and after == before and bool(out["connector_round_trip"])
    del host, cache, backing
    torch.cuda.empty_cache()

    rss0 = rss_bytes()
    t0 = time.perf_counter()
    plain = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out["torch_s"] = time.perf_counter() - t0
    torch_rss = rss_bytes() - rss0
    out["torch_rss_delta"] = torch_rss
    out["torch_expected_reserved"] = caching_pinned_bytes(n)
    del plain

    print(f"pool {n} B ({n / (1 << 30):.3f} GiB, {layout.num_blocks} blocks of gemma-3-1b)")
    print(f"kvstage HostBuffer:  {out['kvstage_bytes']} B pinned={out['kvstage_pinned']} "
          f"resident +{out['kvstage_rss_delta']} B, caching allocator delta "
          f"{out['kvstage_caching_delta']} in {out['kvstage_s']:.3f} s")
    print(f"connector host:      {out['connector_bytes']} B (device "
          f"{out['connector_device_bytes']} B) pinned={out['connector_pinned']} round trip "
          f"{'exact' if out['connector_round_trip'] else 'WRONG'}, caching allocator delta "
          f"{out['connector_caching_delta']} in {out['connector_s']:.3f} s")
    print(f"torch pin_memory:    resident +{torch_rss} B "
          f"({torch_rss - n:+d} B vs the pool; its power of two: "
          f"{out['torch_expected_reserved']}) in {out['torch_s']:.3f} s")
    print("OK: host bytes == device pool bytes, exactly" if ok else "FAILED")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
