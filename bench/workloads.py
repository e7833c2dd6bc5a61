"""What a soak runs on: random layouts per preset, prompt sizes that fit a pool, RSS, and
its bookkeeping (a request record, a prefill/decode pair with its fault switches)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import random
from dataclasses import dataclass, field
from typing import Any

from kvstage.blocks import BlockPool, request_blocks
from kvstage.cache import HostLayout
from kvstage.layout import CacheLayout, KVLayout
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker, RequestResult
from kvstage.presets import cache_layouts_for, preset
from kvstage.testing.servers import PrefillProcess, PrefillThread

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
    sizes = [bs for bs in (4, 8, 16)
             if preset(name, num_blocks=2, block_size=bs).block_bytes * MIN_BLOCKS
             <= 2 * pool_bytes] or [4]
    bs = rng.choice(sizes)
    cache = rng.choice(cache_layouts_for(name))
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


def settled_rss_bytes() -> int:
    """This process's VmRSS after a garbage collection and, on glibc, ``malloc_trim(0)``:
    the memory it holds, not the freed heap pages the allocator keeps for later. Without
    the trim a 150-request soak's RSS grew 46-89 MiB from 10 % to 100 % of the run, with
    it 9.4-9.5 MiB, nearly all of it before 50 % (RELIABILITY.md, after the soak's
    per-pair table)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: VmRSS as it is
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


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


STALLED = ("read_timeout", "abort_stalled", "stalled_resumes")  # faults that stall a READ


# -- bookkeeping ----------------------------------------------------------------------------
@dataclass
class Record:
    request_id: str
    pair: str
    fault: str
    tokens: int
    seed: int
    outcome: str = "unfinished"
    reason: str = ""


@dataclass
class Pair:
    name: str
    choice: LayoutChoice
    layout: KVLayout
    decode: DecodeWorker
    server: PrefillThread | PrefillProcess
    address: tuple[str, int]
    lease_s: float
    faulty: bool = False
    in_flight: dict[str, tuple[Record, RequestResult]] = field(default_factory=dict)
    ready: list[tuple[Record, RequestResult]] = field(default_factory=list)

    @property
    def pool(self) -> BlockPool:
        assert self.decode.pool is not None  # make_decode gives every pair a pool
        return self.decode.pool

    @property
    def busy(self) -> int:
        return len(self.in_flight) + len(self.ready)

    def stats(self) -> m.Stats:
        reply = self.decode.client(*self.address).call(m.GetStats(), timeout_s=5.0)
        assert isinstance(reply, m.Stats)
        return reply

    def set_faults(self, kind: str) -> None:
        t: Any = self.decode.transport
        t.fail_reads = kind == "read_fail"
        t.stall_reads = kind in STALLED
        t.drop_notifs = kind == "notif_lost"
