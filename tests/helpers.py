"""Helpers shared by the test modules: the tests' reference semantics on bytes, state
snapshots for "nothing changed" checks, and the engine fixture of the refusal tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import kvstage as ks
from kvstage import NULL_BLOCK, HostBuffer, KVCache
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker, RequestResult
from kvstage.pd.side_channel import SideChannelClient


def as_bytes(canonical: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 copy ``[T, P, NB, E * itemsize]`` of a canonical view."""
    return canonical.detach().to("cpu").contiguous().view(torch.uint8).clone()


def fill_host_random(host: HostBuffer, seed: int) -> None:
    """Random finite bytes in a host buffer (the same recipe as KVCache.fill_random)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8, generator=gen)
    if host.layout.torch_dtype.is_floating_point:
        raw.view(-1, host.storage.element_size())[:, -1] &= 0x3F
    host.storage.view(-1).view(torch.uint8).copy_(raw)


def make_pair(
    cache: KVCache, host: HostBuffer, seed: int
) -> tuple[KVCache, HostBuffer]:
    """Fill both sides with different random bytes (never zeros: a skipped block or a
    block copied to the wrong place cannot compare equal by accident)."""
    cache.fill_random(seed)
    fill_host_random(host, seed + 1)
    return cache, host


def naive_copy(src: torch.Tensor, dst: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """The reference: a copy of ``dst`` (canonical bytes) where, for every physical
    tensor and every non-null id, one block at a time is copied from ``src``."""
    out = dst.clone()
    for t in range(src.shape[0]):
        for b in ids:
            if b != NULL_BLOCK:
                out[t, :, b] = src[t, :, b]
    return out


def check_invariants(
    *,
    src_before: torch.Tensor,
    src_after: torch.Tensor,
    dst_before: torch.Tensor,
    dst_after: torch.Tensor,
    ids: Sequence[int],
    null_may_change: bool,
) -> None:
    """The three kv_offload invariants, on canonical bytes ``[T, P, NB, E]``.

    ``null_may_change``: the vLLM baselines copy block 0 when it appears in the ids
    (vLLM does: harmless waste), so block 0 is excluded from the untouched check for them;
    fused must never touch it.
    """
    assert torch.equal(src_after, src_before), "the source changed during the copy"
    mapped = sorted({int(b) for b in ids} - {NULL_BLOCK})
    if mapped:
        idx = torch.tensor(mapped)
        assert torch.equal(dst_after[:, :, idx], src_before[:, :, idx]), (
            "a mapped destination block differs from its source"
        )
    keep = [b for b in range(dst_before.shape[2]) if b not in set(mapped)]
    if null_may_change and NULL_BLOCK in {int(b) for b in ids}:
        keep.remove(NULL_BLOCK)
    idx = torch.tensor(keep, dtype=torch.int64)
    assert torch.equal(dst_after[:, :, idx], dst_before[:, :, idx]), (
        "an unmapped destination block was written"
    )
    expected = naive_copy(src_before, dst_before, ids)
    if null_may_change:
        expected[:, :, NULL_BLOCK] = dst_after[:, :, NULL_BLOCK]
    assert torch.equal(dst_after, expected), "destination differs from the naive reference"


# -- snapshots ---------------------------------------------------------------------

def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


@dataclass
class EngineState:
    cache: torch.Tensor
    host: torch.Tensor


def snap(engine: ks.CopyEngine) -> EngineState:
    return EngineState(raw_bytes(engine.cache.slab), raw_bytes(engine.host.storage))


def assert_unchanged(engine: ks.CopyEngine, before: EngineState) -> None:
    assert torch.equal(raw_bytes(engine.cache.slab), before.cache), "device cache changed"
    assert torch.equal(raw_bytes(engine.host.storage), before.host), "host buffer changed"


def pool_state(pool: ks.BlockPool) -> tuple[list[int], list[int]]:
    return list(pool._free), sorted(pool._used)


def ok_ids() -> list[list[int]]:
    return [[10, 11], [12], [], [13], [14], [0, 15], [16, 17]]




# -- P/D helpers -------------------------------------------------------------------
def call(addr: tuple[str, int], msg: m.Message, *, key: bytes | None = None,
         timeout_s: float = 10.0) -> m.Message:
    """One side-channel question to the prefill at ``addr``."""
    return SideChannelClient(*addr, timeout_s=timeout_s, key=key).call(msg)


def stats_of(addr: tuple[str, int], *, key: bytes | None = None) -> m.Stats:
    reply = call(addr, m.GetStats(), key=key)
    assert isinstance(reply, m.Stats)
    return reply


def prefill_request(addr: tuple[str, int], rid: str, tokens: int = 100, seed: int = 1, *,
                    key: bytes | None = None, timeout_s: float = 10.0) -> m.PrefillDone:
    """Ask a pattern-producing prefill to 'run' a prompt; its PrefillDone."""
    done = call(addr, m.PrefillRequest(request_id=rid, num_tokens=tokens, seed=seed), key=key,
                timeout_s=timeout_s)
    assert isinstance(done, m.PrefillDone)
    return done


def start_request(decode: DecodeWorker, addr: tuple[str, int], rid: str, tokens: int,
                  seed: int, local: Sequence[Sequence[int]] | None = None, *,
                  timeout_s: float = 10.0) -> RequestResult:
    """A pattern prefill 'runs' the prompt, then ``decode`` starts reading it."""
    done = prefill_request(addr, rid, tokens, seed, timeout_s=timeout_s)
    return decode.start(rid, addr, done.block_ids, local, capability=done.capability)


def finish_read(decode: DecodeWorker, res: RequestResult,
                timeout_s: float = 15.0) -> RequestResult:
    """Poll (bounded) until ``res`` ends; poll() updates the result in place."""
    deadline = time.monotonic() + timeout_s
    while res.status == "pending" and time.monotonic() < deadline:
        decode.poll()
        time.sleep(0.001)
    assert res.status != "pending", f"{res.request_id} still pending after {timeout_s} s"
    return res


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def wait_prefill_free(addr: tuple[str, int], num_blocks: int, timeout_s: float, *,
                      key: bytes | None = None) -> m.Stats:
    """Bounded wait until prefill holds nothing; its pool must then be whole and every
    request freed exactly once. (A READ's completion reaches prefill as an asynchronous
    NIXL notification, so a stats call right after the decode's last READ may see it
    still held.)"""
    deadline = time.monotonic() + timeout_s
    s = stats_of(addr, key=key)
    while s.held_requests and time.monotonic() < deadline:
        time.sleep(0.02)
        s = stats_of(addr, key=key)
    assert s.held_requests == 0 and s.held_blocks == 0, f"prefill still holds: {s}"
    assert s.free_blocks == num_blocks - 1, f"prefill leaked blocks: {s}"
    assert s.prefilled == s.completed + s.released + s.expired, s
    assert s.open_handles == 0
    return s
