"""A verifiable KV pattern: the bytes of (request seed, group, position) in every tensor.

Prefill writes it into its device cache as the 'forward pass'; decode regenerates it for
its own local block ids and compares every byte, so nothing but block ids crosses the
side channel. Each block differs from every other (key mixes seed, group and position),
so a block landing in the wrong place, or a stale one, cannot compare equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstage.blocks import BlockPool, request_blocks
from kvstage.cache import KVCache
from kvstage.errors import InvalidRequest, PoolExhausted
from kvstage.layout import KVLayout

_GOLDEN = np.uint32(0x9E3779B1)
_MIX = np.uint32(0x85EBCA77)


def _keys(seed: int, group: int, n: int) -> np.ndarray:
    base = (seed * 1_000_003 + group * 10_007) & 0xFFFFFFFF
    return (np.arange(n, dtype=np.uint64) + base).astype(np.uint32)


def pattern(layout: KVLayout, seed: int, group: int, n: int) -> np.ndarray:
    """``[n, block_bytes]`` uint8: block-major rows for positions 0..n-1 of a group."""
    if layout.block_bytes % 4:
        raise ValueError(f"block_bytes {layout.block_bytes} is not a multiple of 4")
    words = np.arange(layout.block_bytes // 4, dtype=np.uint32)
    keys = _keys(seed, group, n)
    with np.errstate(over="ignore"):
        mixed = keys[:, None] * _GOLDEN + words[None, :] * _MIX
        mixed ^= mixed >> np.uint32(15)
    return mixed.view(np.uint8)


def _tensor_bytes(cache: KVCache) -> list[torch.Tensor]:
    """Each physical tensor as ``[P, NB, E_bytes]`` uint8 (engine-owned tensors too)."""
    _, p, nb, _ = cache.layout.canonical_shape
    return [v.view(torch.uint8).view(p, nb, -1) for v in cache.tensor_views]


def _rows(layout: KVLayout, rows: np.ndarray) -> torch.Tensor:
    """block-major rows [n, block_bytes] -> [T, P, n, E_bytes] canonical order."""
    t, p = layout.num_tensors, layout.num_planes
    return torch.from_numpy(rows).view(rows.shape[0], t, p, -1).permute(1, 2, 0, 3)


def fill_request(cache: KVCache, block_ids: Sequence[Sequence[int]], seed: int) -> None:
    """Write the pattern of every (group, position) into its block, every tensor."""
    tensors = _tensor_bytes(cache)
    for g, ids in enumerate(block_ids):
        if not ids:
            continue
        idx = torch.tensor(list(ids), dtype=torch.int64, device=cache.device)
        rows = _rows(cache.layout, pattern(cache.layout, seed, g, len(ids))).to(cache.device)
        for t, dst in enumerate(tensors):
            dst[:, idx] = rows[t]


def verify_request(
    cache: KVCache, block_ids: Sequence[Sequence[int]], seed: int, *, skip: int = 0
) -> list[str]:
    """Mismatches (empty list = every byte right). ``block_ids[g][i]`` must hold pattern
    position ``skip + i`` of group g (``skip`` > 0 when decode already held a prefix)."""
    tensors = _tensor_bytes(cache)
    problems = []
    for g, ids in enumerate(block_ids):
        if not ids:
            continue
        idx = torch.tensor(list(ids), dtype=torch.int64, device=cache.device)
        got = torch.stack([src[:, idx] for src in tensors]).cpu()
        want = _rows(cache.layout, pattern(cache.layout, seed, g, len(ids) + skip)[skip:])
        bad = (got != want).flatten(start_dim=3).any(dim=3).any(dim=0).any(dim=0)
        for pos in torch.nonzero(bad).flatten().tolist():
            problems.append(f"group {g} position {pos} (block {ids[pos]}) differs")
    return problems


class PatternProducer:
    """The stand-in forward pass of the CLI, demo, benches and tests: allocate a prompt's
    blocks from ``pool`` and write the pattern into them (a `prefill.Producer`)."""

    def __init__(self, cache: KVCache, pool: BlockPool, *, max_tokens: int = 1 << 22) -> None:
        self.cache, self.pool, self.max_tokens = cache, pool, max_tokens

    def __call__(self, request_id: str, num_tokens: int, seed: int) -> list[list[int]]:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidRequest(f"num_tokens must be a positive int, got {num_tokens!r}")
        if num_tokens > self.max_tokens:
            raise InvalidRequest(
                f"a {num_tokens}-token prompt is over this worker's limit of "
                f"{self.max_tokens} tokens"
            )
        counts = request_blocks(self.cache.layout, num_tokens)
        if sum(counts) > self.pool.num_free:
            raise PoolExhausted(
                f"a {num_tokens}-token prompt needs {sum(counts)} blocks, only "
                f"{self.pool.num_free} are free; start the worker with more blocks"
            )
        block_ids = [self.pool.allocate(n) for n in counts]
        fill_request(self.cache, block_ids, seed)
        return block_ids
