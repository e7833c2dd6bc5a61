"""What a soak runs on: random layouts per preset, prompt sizes that fit a pool, RSS."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvstage.blocks import request_blocks
from kvstage.cache import HostLayout
from kvstage.layout import CacheLayout, KVLayout, MLASpec
from kvstage.presets import preset

MIN_BLOCKS = 48


@dataclass(frozen=True)
class LayoutChoice:
    """A preset with the knobs a soak randomises; picklable for a spawned child."""

    preset: str
    num_blocks: int
    block_size: int = 16
    cache_layout: str = CacheLayout.PACKED.value
    host_layout: str = HostLayout.BLOCK_MAJOR.value

    def layout(self) -> KVLayout:
        return preset(self.preset, num_blocks=self.num_blocks, block_size=self.block_size,
                      cache_layout=CacheLayout(self.cache_layout))

    def describe(self) -> str:
        return (f"{self.preset} (block_size {self.block_size}, {self.cache_layout}, "
                f"host {self.host_layout}, {self.num_blocks} blocks)")


def random_choice(name: str, rng: random.Random, pool_bytes: int) -> LayoutChoice:
    """Block size, cache and host layout at random; ``num_blocks`` so the pool is about
    ``pool_bytes`` (at least `MIN_BLOCKS`; block sizes whose pool would exceed twice the
    target at that minimum are skipped: llama-3.1-8b at block_size 16 is 2 MiB a block)."""
    is_mla = isinstance(preset(name, num_blocks=2).spec, MLASpec)
    sizes = [bs for bs in (4, 8, 16)
             if preset(name, num_blocks=2, block_size=bs).block_bytes * MIN_BLOCKS
             <= 2 * pool_bytes] or [4]
    bs = rng.choice(sizes)
    cache = CacheLayout.PACKED if is_mla else rng.choice(list(CacheLayout))
    host = rng.choice(list(HostLayout))
    block_bytes = preset(name, num_blocks=2, block_size=bs).block_bytes
    blocks = max(MIN_BLOCKS, pool_bytes // block_bytes)
    return LayoutChoice(name, blocks, bs, cache.value, host.value)


def max_tokens(layout: KVLayout, budget_blocks: int) -> int:
    """Largest prompt whose blocks (all groups, sliding windows clipped) fit the budget."""
    lo, hi = 1, 1 << 20
    if sum(request_blocks(layout, 1)) > budget_blocks:
        return 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(request_blocks(layout, mid)) <= budget_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def rss_bytes(pid: int | str = "self") -> int:
    """VmRSS from /proc/PID/status (0 where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
