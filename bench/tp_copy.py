"""`python -m bench.tp_copy`: the head-split d2h and h2d across TP sizes against a plain copy
of the same bytes (CPU, or CUDA with ``--device cuda``: `scripts/gpu_check.sh` runs it).

A Llama-3.1-8B-sized rank (``--layers`` 32, ``--kv-heads`` 8 of ``--head-size`` 128,
bf16, ``--block-size`` 16) laid out as vLLM 0.32.0 hands it (one backing buffer, a
``[blocks, heads, tokens, 2 x head]`` view per layer, layer-major), one request of
``--blocks`` blocks in one run. Per case, interleaved over ``--iters`` rounds, median us
and GB/s of the bytes moved:

- ``whole d2h`` / ``whole h2d``: kvstage's `CopyEngine` at equal TP sizes (whole pages);
- ``slices d2h``: the prefill's d2h cut into ``--parts`` head slices (`pd.tp_copy.PartCopy`);
- ``region h2d``: one decode region's h2d (1/parts of the bytes, its heads of each page);
- ``memcpy``: one contiguous ``copy_`` of the request's bytes (pinned host on CUDA).

Copy calls per request are counted (`PartCopy.ops`, `CopyEngine.stats`), and the bytes of
each decode region after the slices' d2h and the region's h2d checked against the device
(exit 1 if not equal). Writes ``--json``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstage.bench.report import machine_info, write_json
from kvstage.cache import HostBuffer
from kvstage.engine import CopyEngine, Direction
from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.integrations.vllm.tp import cut_pages
from kvstage.pd.tp_copy import HostPart, PartCopy


@dataclass(frozen=True)
class FullAttentionSpec:  # vLLM's spec name and the attributes kvstage reads
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16


def rank(layers: int, heads: int, head: int, block: int, blocks: int, device: str
         ) -> tuple[dict[str, torch.Tensor], list]:
    page = heads * block * 2 * head  # elements of one layer's block
    buf = torch.randn(layers * blocks * page, dtype=torch.float32).to(torch.bfloat16).to(device)
    caches = {f"l{i}": buf[i * blocks * page:(i + 1) * blocks * page].view(
        blocks, heads, block, 2 * head) for i in range(layers)}
    groups = [([f"l{i}" for i in range(layers)],
               FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head))]
    return caches, groups


def _time(fn: object, sync: bool) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=64, help="the request's blocks (one run)")
    p.add_argument("--pool-blocks", type=int, default=96)
    p.add_argument("--parts", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU; default 1)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench.tp_copy: --device cuda needs a CUDA device; none is visible",
              file=sys.stderr)
        return 2
    caches, groups = rank(a.layers, a.kv_heads, a.head_size, a.block_size, a.pool_blocks,
                          a.device)
    cache = wrap_vllm_caches(caches, groups, a.pool_blocks, "llama-8b-like")
    parts = cut_pages(caches, groups, cache.layout, a.parts, "llama-8b-like")
    host = HostBuffer.for_device(cache.layout, cache.device)
    whole = CopyEngine(cache, host)
    slices = PartCopy(cache, host, parts)
    region = PartCopy(cache, host, parts, region=0)
    ids = [list(range(1, 1 + a.blocks))]
    plan_w, plan_s = whole.plan(ids), slices.plan(ids)
    nbytes = a.blocks * cache.layout.block_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
    dst = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if a.device == "cuda"
           else torch.empty(nbytes, dtype=torch.uint8))
    sync = a.device == "cuda"
    nb = a.device == "cuda"
    cases = {
        "whole d2h": (lambda: whole.run(plan_w, Direction.D2H, sync=False), nbytes,
                      whole.stats(plan_w, Direction.D2H).ops),
        "whole h2d": (lambda: whole.run(plan_w, Direction.H2D, sync=False), nbytes,
                      whole.stats(plan_w, Direction.H2D).ops),
        "slices d2h": (lambda: slices.run(plan_s, Direction.D2H, sync=False), nbytes,
                       slices.ops(plan_s, Direction.D2H)),
        "region h2d": (lambda: region.run(plan_s, Direction.H2D, sync=False),
                       nbytes // a.parts, region.ops(plan_s, Direction.H2D)),
        "memcpy": (lambda: dst.copy_(src, non_blocking=nb), nbytes, 1),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.iters):  # interleaved
        for name, (fn, _, _) in cases.items():
            times[name].append(_time(fn, sync))
    # bytes: each region of the host rows after the slices' d2h equals the device's heads
    slices.run(plan_s, Direction.D2H)
    ok = True
    for r in range(a.parts):
        got = HostPart(host, parts, r).storage[1:1 + a.blocks].cpu()
        h = a.kv_heads // a.parts
        want = torch.stack([caches[f"l{i}"][1:1 + a.blocks, r * h:(r + 1) * h].cpu()
                            for i in range(a.layers)], dim=1)
        ok &= torch.equal(got.view(torch.bfloat16).reshape(want.shape), want)
    rows: list[dict[str, object]] = []
    for name, (_, moved, ops) in cases.items():
        med = statistics.median(times[name])
        rows.append({"case": name, "median_us": med, "bytes": moved, "ops": ops,
                     "gbps": moved / med / 1e3})
    print(f"| case ({a.device}, {a.layers} layers x {a.kv_heads} KV heads, {a.blocks} blocks, "
          f"{a.parts} parts) | median us | GB/s | bytes | copy calls |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['case']} | {row['median_us']:.0f} | {row['gbps']:.2f} | "
              f"{row['bytes']} | {row['ops']} |")
    print(f"bytes of every region equal the device's heads: {ok}")
    if a.json:
        write_json(a.json, config=vars(a) | {"json": str(a.json)},
                   env=machine_info(a.device), timings=rows, bytes_exact=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
