"""Chunked prefill: `PrefillWorker.save` once per prefill step, only new blocks plus the
block a chunk boundary cut in two, which the next step completes and saves again."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kvstage import KVCache, preset
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.prefill import PrefillWorker
from kvstage.testing.servers import PrefillThread
from kvstage.transport import make_transport
from tests.helpers import finish_read

pytestmark = pytest.mark.timeout(60)

LAYOUT = preset("gemma-3-1b", num_blocks=64, block_size=4)  # 7 groups, 4 tensors, 4 tokens/block
TOKENS_PER_BLOCK = 4


def write_tokens(cache: KVCache, block_ids: list[list[int]], lo: int, hi: int,
                 gen: torch.Generator) -> None:
    """The engine's forward pass for tokens [lo, hi): every layer's K and V of those tokens
    in the blocks that hold them (one list per group, same token positions)."""
    for view in cache.tensor_views:  # [1, num_blocks, E]: a block is 4 tokens x E/4
        per_token = view.shape[-1] // TOKENS_PER_BLOCK
        for ids in block_ids:
            for t in range(lo, hi):
                b = ids[t // TOKENS_PER_BLOCK]
                off = (t % TOKENS_PER_BLOCK) * per_token
                row = view[0, b, off : off + per_token].view(torch.int16)
                row.copy_(torch.randint(-2**15, 2**15, row.shape, generator=gen,
                                        dtype=torch.int16))


@contextmanager
def roles() -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker(KVCache(LAYOUT), make_transport("loopback", "chunk-p"))
    decode = DecodeWorker(KVCache(LAYOUT), make_transport("loopback", "chunk-d"))
    with PrefillThread(prefill), decode:
        yield prefill, decode


@pytest.mark.parametrize("resave_boundary", [True, False], ids=["resaved", "vllm-per-step"])
def test_uneven_chunks_with_a_block_cut_by_a_boundary(resave_boundary: bool) -> None:
    """A 22-token prompt (6 blocks) prefilled in 4 uneven chunks: 5, 9, 3, 5 tokens. Chunk
    boundaries at tokens 5, 14 and 17 fall inside blocks 1, 3 and 4. Saving the cut block
    again with the next chunk gives decode every byte; saving only new blocks (what vLLM's
    per-step save does) leaves the first part of each cut block stale on decode."""
    gen = torch.Generator().manual_seed(7)
    remote = [[g * 6 + 1 + i for i in range(6)] for g in range(LAYOUT.num_groups)]
    local = [[50 - g * 6 - i for i in range(6)] for g in range(LAYOUT.num_groups)]
    with roles() as (prefill, decode):
        saved = 0  # blocks [0, saved) of every group have been saved completely
        for lo, hi in ((0, 5), (5, 14), (14, 17), (17, 22)):
            write_tokens(prefill.cache, remote, lo, hi, gen)
            first = lo // TOKENS_PER_BLOCK if resave_boundary else saved
            last = -(-hi // TOKENS_PER_BLOCK)  # the block holding token hi - 1
            prefill.save("req", [ids[first:last] for ids in remote])
            saved = last
        done = prefill.hold("req")
        assert done.block_ids == remote  # each block once, in order, whatever was resaved
        res = finish_read(decode, decode.start("req", prefill.address, done.block_ids, local,
                                               capability=done.capability))
        assert res.status == "done", res.reason
        stale = [
            (t, rb) for t, (src, dst) in enumerate(zip(prefill.cache.tensor_views,
                                                      decode.cache.tensor_views, strict=True))
            for rids, lids in zip(remote, local, strict=True)
            for rb, lb in zip(rids, lids, strict=True)
            if not torch.equal(src[0, rb].view(torch.int16), dst[0, lb].view(torch.int16))
        ]
    if resave_boundary:
        assert stale == []
    else:  # blocks 1, 3 and 4 of every group, every tensor: the cut blocks
        cut = {remote[g][b] for g in range(LAYOUT.num_groups) for b in (1, 3, 4)}
        assert {rb for _, rb in stale} == cut
