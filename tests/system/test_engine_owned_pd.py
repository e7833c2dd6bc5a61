"""The library roles inside an engine: caches and block ids the engine owns, real NIXL.

Both sides build their KV caches the way vLLM does (one tensor per physical KV cache
tensor; gemma-3-1b's 26 layer names alias 4 tensors), allocate block ids from their own
allocator (not kvstage's BlockPool), and run their own "forward pass". Prefill saves
in chunks as a chunked prefill would, holds, and decode READs into the ids its engine
allocated, then loads them to the device: byte-exact, and kvstage allocates neither
cache.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from kvstage import KVCache, KVLayout, SlidingWindowSpec, layout_from_layers, preset
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.prefill import PrefillWorker
from kvstage.testing.servers import PrefillThread
from kvstage.transport import make_transport

pytestmark = pytest.mark.nixl

NUM_BLOCKS = 96


class EngineAllocator:
    """A stand-in for an engine's block allocator: hands out ids from the top down."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)
        self.freed: list[tuple[str, list[list[int]]]] = []

    def allocate(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def on_free(self, request_id: str, block_ids: list[list[int]]) -> None:
        self.freed.append((request_id, block_ids))
        self.free += [b for g in block_ids for b in g]


def engine_caches(seed: int) -> tuple[KVLayout, dict[str, torch.Tensor], list[torch.Tensor]]:
    """gemma-3-1b's cache as vLLM hands it to a connector: layer name -> tensor."""
    ref = preset("gemma-3-1b", num_blocks=NUM_BLOCKS)
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.zeros(ref.layer_shape, dtype=ref.torch_dtype) for _ in range(4)]
    for t in tensors:
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=gen,
                                                dtype=torch.int16))
    layers = {n: tensors[i] for g in ref.groups for i, n in enumerate(g.layer_names)}
    layout = layout_from_layers(layers, [(g.layer_names, g.spec) for g in ref.groups])
    return layout, layers, tensors


def forward(layers: dict[str, torch.Tensor], layout: KVLayout, ids: list[list[int]],
            seed: int) -> None:
    """The engine's forward pass: write KV through each group's own layer names."""
    gen = torch.Generator().manual_seed(seed)
    for group, group_ids in zip(layout.groups, ids, strict=True):
        for name in group.layer_names:
            for b in group_ids:
                layers[name][b].view(torch.int16).copy_(torch.randint(
                    -2**15, 2**15, layers[name][b].shape, generator=gen, dtype=torch.int16))


@pytest.mark.timeout(120)
def test_engine_owned_caches_and_ids_over_real_nixl() -> None:
    p_layout, p_layers, p_tensors = engine_caches(seed=1)
    d_layout, d_layers, d_tensors = engine_caches(seed=2)
    p_alloc, d_alloc = EngineAllocator(NUM_BLOCKS, 3), EngineAllocator(NUM_BLOCKS, 4)
    prefill = PrefillWorker(
        KVCache.wrap_layers(p_layout, p_layers), make_transport("nixl", "engine-prefill"),
        on_free=p_alloc.on_free,
    )
    decode = DecodeWorker(
        KVCache.wrap_layers(d_layout, d_layers), make_transport("nixl", "engine-decode"),
        read_timeout_s=10.0,
    )
    assert all(c.owned is False for c in (prefill.cache, decode.cache))
    with decode, prefill:  # closed even if a step before serving fails
        # the worker is single-threaded: the engine saves and holds, then serves
        # a 700-token prompt in three chunked-prefill steps; sliding-window groups keep
        # their last 33 blocks, the full-attention group all 44
        counts = [33 if isinstance(g.spec, SlidingWindowSpec) else 44 for g in p_layout.groups]
        ids = [p_alloc.allocate(n) for n in counts]
        forward(p_layers, p_layout, ids, seed=5)
        for lo, hi in ((0, 10), (10, 25), (25, 44)):  # only new blocks each step
            step = [g[lo:hi] for g in ids]
            if any(step):
                prefill.save("req-1", step)
        done = prefill.hold("req-1")
        assert done.block_ids == ids
        with PrefillThread(prefill):
            local = [d_alloc.allocate(len(g)) for g in ids]
            res = decode.start("req-1", prefill.address, done.block_ids, local,
                               capability=done.capability)
            if res.status == "pending":
                res = decode.wait("req-1", 20.0)
            assert res.status == "done", res.reason
            for t in range(p_layout.num_tensors):
                for g_remote, g_local in zip(ids, local, strict=True):
                    for rb, lb in zip(g_remote, g_local, strict=True):
                        assert torch.equal(d_tensors[t][lb].view(torch.int16),
                                           p_tensors[t][rb].view(torch.int16)), (t, rb, lb)
            # decode's notification frees the prefill engine's blocks through its callback
            deadline = time.monotonic() + 5.0
            while not p_alloc.freed and time.monotonic() < deadline:
                time.sleep(0.02)
            assert p_alloc.freed == [("req-1", ids)]
            assert prefill.stats().held_requests == 0
