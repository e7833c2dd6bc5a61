"""The buffers of one `kvstage bench copy` case (`Bench`) and the copy engine of each
strategy (`make_variant`): what the timings (`kvstage.bench.copy`) and the op counts and
memory checks (`kvstage.bench.copy_counts`) share. Allocates the case's device cache,
host buffers and memcpy reference at construction; single-threaded like the bench.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from kvstage.bench.copy_cases import Case
from kvstage.blocks import GroupedBlockIds
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.engine import CopyEngine, Direction
from kvstage.plan import plan_copy
from kvstage.testing.baselines import BaselineEngine, make_engine


def make_variant(cache: KVCache, host: HostBuffer, strategy: str, max_temp_bytes: int,
            mode: str) -> CopyEngine | BaselineEngine:
    options: dict[str, Any] = {"max_temp_bytes": max_temp_bytes, "mode": mode}
    return make_engine(cache, host, strategy, **(options if strategy == "fused" else {}))



class Bench:
    """The buffers and engines of one case: a variant per (strategy, host layout)."""

    def __init__(self, case: Case, args: argparse.Namespace) -> None:
        self.case, self.device = case, args.device
        self.cuda = args.device == "cuda"
        self.cache = KVCache(case.layout, args.device)
        self.cache.fill_random(args.seed)
        self.ids = GroupedBlockIds(case.groups, case.layout)
        self.plan = plan_copy(case.layout, self.ids, max_temp_bytes=args.max_temp_bytes)
        hosts = [HostLayout(h) for h in args.host_layout]
        self.hosts = {h: HostBuffer.for_device(case.layout, args.device, h) for h in hosts}
        multi = len(hosts) > 1
        self.variants: dict[str, tuple[CopyEngine | BaselineEngine, HostLayout]] = {}
        for strategy in args.strategies:
            for h in hosts if strategy == "fused" else hosts[:1]:
                name = f"fused[{h.value}]" if strategy == "fused" and multi else strategy
                engine = make_variant(self.cache, self.hosts[h], strategy, args.max_temp_bytes,
                                 args.fused_mode)
                self.variants[name] = (engine, h)
        # the memcpy reference: one contiguous copy_ of fused's bytes, host <-> device
        # (in the KV dtype, so the same copy kernel runs; only the strides differ)
        n = self.plan.nbytes // case.layout.dtype_bytes
        dtype = case.layout.torch_dtype
        self.dev_flat = torch.ones(n, dtype=dtype, device=args.device)
        self.host_flat = torch.ones(n, dtype=dtype, pin_memory=self.cuda)

    def request(self, name: str, direction: Direction) -> Callable[[], Any]:
        """One request as a caller makes it: per-group id lists, validated every call."""
        engine, groups = self.variants[name][0], self.case.groups
        return lambda: engine.copy(groups, direction)

    def copies(self, direction: Direction) -> Callable[[], Any]:
        """fused's copies alone: one ``copy_`` per run between views sliced beforehand
        (no validation, planning or slicing), into the first fused variant's host."""
        host = next((self.hosts[h] for n, (_, h) in self.variants.items()
                     if n.startswith("fused")), next(iter(self.hosts.values())))
        dev, hst = self.cache.canonical, host.canonical
        assert dev is not None  # the bench allocates kvstage's own slab
        pairs = [(hst.narrow(2, d, n), dev.narrow(2, s, n)) for s, d, n in self.plan.run_list]
        if direction is Direction.H2D:
            pairs = [(b, a) for a, b in pairs]
        nb = self.cuda
        return lambda: [dst.copy_(src, non_blocking=nb) for dst, src in pairs]

    def memcpy(self, direction: Direction) -> Callable[[], Any]:
        src, dst = self.dev_flat, self.host_flat
        if direction is Direction.H2D:
            src, dst = dst, src
        return lambda: dst.copy_(src, non_blocking=self.cuda)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def verify(self, name: str, direction: Direction) -> bool:
        """Copy once into zeroed destination blocks and compare with the source blocks."""
        engine, h = self.variants[name]
        dev, host = self.cache.canonical, self.hosts[h].canonical
        assert dev is not None  # the bench allocates kvstage's own slab
        ids = torch.from_numpy(self.plan.block_ids.copy())
        dev_ids = ids.to(dev.device)
        want = dev[:, :, dev_ids].cpu()  # random bytes (fill_random): no false match
        if direction is Direction.D2H:
            host[:, :, ids] = 0
        else:
            host[:, :, ids] = want  # what h2d must bring back, wherever it came from
            dev[:, :, dev_ids] = 0
        engine.copy(self.ids, direction)
        self.sync()
        got = host[:, :, ids] if direction is Direction.D2H else dev[:, :, dev_ids].cpu()
        return bool(torch.equal(got, want))
