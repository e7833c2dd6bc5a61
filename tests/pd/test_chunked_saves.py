"""Chunked prefill: `PrefillWorker.save` once per prefill step, only new blocks plus the
block a chunk boundary cut in two, which the next step completes and saves again; with
``wait=False`` the copies run in the background (`kvstage.pd.saves`) while the next chunk
is written, and ``hold`` waits for them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kvstage import KVCache, preset
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.prefill import PrefillWorker
from kvstage.plan import runs_of_ids
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
def roles(checksum: bool = False) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker(KVCache(LAYOUT), make_transport("loopback", "chunk-p"),
                            verify_checksum=checksum)
    decode = DecodeWorker(KVCache(LAYOUT), make_transport("loopback", "chunk-d"),
                          verify_checksum=checksum)
    with prefill, decode:
        yield prefill, decode


WAITS = {"sync": (True,) * 4, "async": (False,) * 4, "mixed": (False, True, False, False)}


@pytest.mark.parametrize(("resave_boundary", "waits", "checksum"), [
    (True, "sync", False), (False, "sync", False), (True, "async", False),
    (True, "mixed", False), (True, "async", True),
], ids=["resaved", "vllm-per-step", "resaved-async", "resaved-mixed", "async-checksum"])
# (no per-step async case: whether a cut block's first copy runs before or after the next
# chunk's writes is a race, so which bytes go stale is not determined; re-saving is what
# makes the result exact)
def test_uneven_chunks_with_a_block_cut_by_a_boundary(resave_boundary: bool, waits: str,
                                                      checksum: bool) -> None:
    """A 22-token prompt (6 blocks) prefilled in 4 uneven chunks: 5, 9, 3, 5 tokens. Chunk
    boundaries at tokens 5, 14 and 17 fall inside blocks 1, 3 and 4. Saving the cut block
    again with the next chunk gives decode every byte; saving only new blocks (what vLLM's
    per-step save does) leaves the first part of each cut block stale on decode."""
    gen = torch.Generator().manual_seed(7)
    remote = [[g * 6 + 1 + i for i in range(6)] for g in range(LAYOUT.num_groups)]
    local = [[50 - g * 6 - i for i in range(6)] for g in range(LAYOUT.num_groups)]
    with roles(checksum) as (prefill, decode):
        saved = 0  # blocks [0, saved) of every group have been saved completely
        chunks = ((0, 5), (5, 14), (14, 17), (17, 22))
        for (lo, hi), wait in zip(chunks, WAITS[waits], strict=True):
            # with wait=False the previous chunk's copy may still be running: the engine
            # writes the next tokens (of the cut block too) beside it
            write_tokens(prefill.cache, remote, lo, hi, gen)
            first = lo // TOKENS_PER_BLOCK if resave_boundary else saved
            last = -(-hi // TOKENS_PER_BLOCK)  # the block holding token hi - 1
            prefill.save("req", [ids[first:last] for ids in remote], wait=wait)
            saved = last
        done = prefill.hold("req")
        assert done.block_ids == remote  # each block once, in order, whatever was resaved
        with PrefillThread(prefill):  # served only now: the worker is single-threaded
            res = finish_read(decode, decode.start("req", prefill.address, done.block_ids,
                                                   local, capability=done.capability))
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


class Gate:
    """Fault injection: the background copies wait until ``open`` (another thread)."""

    def __init__(self, prefill: PrefillWorker) -> None:
        self.event = threading.Event()
        self.order: list[str] = []
        timed = prefill._saves._timed

        def gated(copy: Any) -> float:
            assert self.event.wait(10)
            secs = timed(copy)
            self.order.append("copied")
            return secs

        prefill._saves._timed = gated  # type: ignore[method-assign]

    def open_later(self, delay_s: float = 0.2) -> threading.Timer:
        timer = threading.Timer(delay_s, self.event.set)
        timer.start()
        return timer


def test_release_waits_for_queued_copies_before_blocks_go_back() -> None:
    prefill = PrefillWorker(KVCache(LAYOUT), make_transport("loopback", "gate-p"))
    with prefill:
        gate = Gate(prefill)
        prefill.on_free = lambda rid, ids: gate.order.append(f"freed {rid}")
        prefill.save("r", [[1 + 3 * g, 2 + 3 * g] for g in range(LAYOUT.num_groups)],
                     wait=False)
        prefill.save("r", [[3 + 3 * g] for g in range(LAYOUT.num_groups)], wait=False)
        assert prefill._saves.pending("r") == 2
        gate.open_later()
        prefill.release("r")  # blocks until both copies are over
        assert gate.order == ["copied", "copied", "freed r"]
        assert prefill._saves.pending("r") == 0


def test_hold_raises_a_background_copy_error_and_release_still_frees() -> None:
    freed: list[list[list[int]]] = []
    prefill = PrefillWorker(KVCache(LAYOUT), make_transport("loopback", "err-p"),
                            on_free=lambda rid, ids: freed.append(ids))

    def broken(copy: Any) -> float:
        raise RuntimeError("injected copy failure")

    with prefill:
        prefill._saves._timed = broken  # type: ignore[method-assign]
        ids = [[4 + 2 * g, 5 + 2 * g] for g in range(LAYOUT.num_groups)]
        prefill.save("r", ids, wait=False)
        with pytest.raises(RuntimeError, match="injected copy failure"):
            prefill.hold("r")
        assert prefill.num_held == 0  # never offered to a decode
        prefill.release("r")
        assert freed == [ids]


def test_hold_without_waiting_copies_holds_finished_bytes() -> None:
    """``hold`` right after a queued save returns only once the bytes are in the host
    buffer: the host rows equal the device blocks at that moment."""
    gen = torch.Generator().manual_seed(3)
    ids = [[g * 2 + 1, g * 2 + 2] for g in range(LAYOUT.num_groups)]
    prefill = PrefillWorker(KVCache(LAYOUT), make_transport("loopback", "hold-p"))
    with prefill:
        write_tokens(prefill.cache, ids, 0, 8, gen)
        gate = Gate(prefill)
        prefill.save("r", ids, wait=False)
        gate.open_later()
        done = prefill.hold("r")
        assert gate.order == ["copied"]
        assert done.nbytes == 2 * LAYOUT.num_groups * LAYOUT.block_bytes
        host = prefill.host.canonical  # [T, P, NB, E]
        for t, dev in enumerate(prefill.cache.tensor_views):  # [P, NB, E]
            for b in {b for g in ids for b in g}:
                assert torch.equal(host[t][:, b].view(torch.int16),
                                   dev[:, b].view(torch.int16)), (t, b)


@pytest.mark.gpu
def test_queued_saves_on_cuda_use_the_copy_stream_after_the_forward() -> None:
    """CUDA: the copy stream waits for the stream that wrote the KV, so a save queued
    right after the write copies the written bytes; ``hold`` synchronises its event."""
    cache = KVCache(LAYOUT, "cuda")
    ids = [[g * 2 + 1, g * 2 + 2] for g in range(LAYOUT.num_groups)]
    prefill = PrefillWorker(cache, make_transport("loopback", "cuda-p"))
    with prefill:
        assert prefill._saves.cuda
        for view in cache.tensor_views:  # the "forward pass", on the current stream
            view.fill_(0)
            view.add_(7)
        prefill.save("r", ids, wait=False)
        done = prefill.hold("r")
        assert done.d2h_s > 0
        host = prefill.host.canonical
        for t in range(len(cache.tensor_views)):
            for b in {b for g in ids for b in g}:
                assert bool((host[t][:, b].view(torch.uint8) != 0).any()), (t, b)
                assert torch.equal(host[t][:, b].cpu(), cache.tensor_views[t][:, b].cpu())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_queued_runs_drain_then_wait(device: str) -> None:
    """The vLLM connector's form (`submit_runs`: trusted runs, no plan): ``drain`` waits
    for every queued copy and keeps each request's figures for ``wait``."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    cache = KVCache(LAYOUT, device)
    with PrefillWorker(cache, make_transport("loopback", f"runs-{device}")) as prefill:
        for view in cache.tensor_views:  # the "forward pass", on the current stream
            view.fill_(3)
        queue = prefill._saves
        queue.submit_runs("a", runs_of_ids([5, 6, 7, 9]))
        queue.submit_runs("b", runs_of_ids([11]))
        queue.submit_runs("b", [])  # nothing to copy: nothing queued
        assert (queue.pending("a"), queue.pending("b"), queue.busy) == (1, 1, True)
        queue.drain()
        host = prefill.host.canonical
        for t in range(len(cache.tensor_views)):
            for b in (5, 6, 7, 9, 11):
                assert torch.equal(host[t][:, b].cpu(), cache.tensor_views[t][:, b].cpu())
            assert not bool(host[t][:, 8].view(torch.uint8).any())  # never queued
        assert queue.wait("a") > 0 and queue.wait("b") > 0 and not queue.busy
