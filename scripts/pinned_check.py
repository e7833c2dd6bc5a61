"""Pinned host memory on CUDA: what PyTorch's pinned allocator locks vs kvstage's exact pages.

    python scripts/pinned_check.py [--gib 3.2] [--json OUT]

For a KV pool of about ``--gib`` GiB (the gemma-3-1b preset, its block count chosen to reach
that size; not a power of two), reports and asserts:
- kvstage's host buffer (`HostBuffer.for_device(layout, "cuda")`): pinned, exactly
  ``layout.pool_bytes``, and PyTorch's caching host allocator untouched (its
  ``allocated_bytes`` / ``reserved_bytes`` unchanged);
- the connector's mirror buffers (`mirror_host_buffers`) of a device pool of the same bytes:
  pinned, ``host_nbytes`` equal to the device's, the caching allocator untouched;
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

import torch

from kvstage import HostBuffer
from kvstage.integrations.vllm.host_buffers import host_nbytes, mirror_host_buffers
from kvstage.pinned import caching_pinned_bytes
from kvstage.presets import preset


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

    device = {"kv": torch.zeros(n, dtype=torch.uint8, device="cuda")}
    device["alias"] = device["kv"][: n // 2]  # two layer names on one storage
    before = host_stats()
    t0 = time.perf_counter()
    host = mirror_host_buffers(device)
    out["mirror_s"] = time.perf_counter() - t0
    after = host_stats()
    out["mirror_bytes"] = host_nbytes(host)
    out["mirror_caching_delta"] = {k: after[k] - before.get(k, 0) for k in after}
    ok &= host_nbytes(host) == n and all(t.is_pinned() for t in host.values()) \
        and after == before
    del host, device
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
    print(f"connector mirrors:   {out['mirror_bytes']} B "
          f"caching allocator delta {out['mirror_caching_delta']} in {out['mirror_s']:.3f} s")
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
