"""Block ids: one pool shared by every KV cache group, and a request's per-group ids.

All groups allocate from one `BlockPool`, so a non-null id is held by at most one group
of one request; id 0 is the null block (sliding-window padding) and is never copied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from kvstage.errors import PoolExhausted
from kvstage.layout import KVLayout, SlidingWindowSpec

NULL_BLOCK = 0


class BlockPool:
    """Free queue over ids 1..num_blocks-1, like vLLM's: allocate pops from the head,
    free appends to the tail, so after a few allocate/free cycles the ids a request gets
    are scattered."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"BlockPool needs num_blocks >= 2 (0 is null), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate(n) needs an int n >= 0, got {n!r}")
        if n > len(self._free):
            raise PoolExhausted(
                f"cannot allocate {n} blocks: only {len(self._free)} of "
                f"{self.num_blocks - 1} are free; free some or build a larger pool"
            )
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def claim(self, ids: Iterable[int]) -> list[int]:
        """Allocate these specific ids (an engine that picks ids itself); all or none."""
        want = [int(i) for i in ids if int(i) != NULL_BLOCK]
        bad = [i for i in want if not 0 < i < self.num_blocks or i in self._used]
        if bad or len(set(want)) != len(want):
            raise PoolExhausted(
                f"claim() got ids that are out of range, allocated or repeated: "
                f"{sorted(set(bad))[:8]}; claim free ids 1..{self.num_blocks - 1} once"
            )
        taken = set(want)
        self._free = deque(i for i in self._free if i not in taken)
        self._used.update(want)
        return want

    def is_free(self, block_id: int) -> bool:
        """True when ``block_id`` (1..num_blocks-1) is not allocated."""
        return block_id not in self._used

    def free(self, ids: Iterable[int]) -> None:
        ids = [int(i) for i in ids if int(i) != NULL_BLOCK]
        unknown = [i for i in ids if i not in self._used]
        if unknown or len(set(ids)) != len(ids):
            raise ValueError(
                f"free() got ids that are not allocated (or repeated): {sorted(set(unknown))[:8]}"
                "; each allocated id is freed exactly once"
            )
        self._used.difference_update(ids)
        self._free.extend(ids)


class GroupedBlockIds:
    """A request's block ids, one list per KV cache group, validated against a layout.

    Stored as one flat int64 array plus per-group sizes (the vLLM kv_offload shape).
    """

    __slots__ = ("flat", "group_sizes", "num_blocks")

    def __init__(self, groups: Sequence[Sequence[int]], layout: KVLayout) -> None:
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
            raise TypeError(
                f"block ids must be a sequence of per-group id lists, got {type(groups).__name__}"
            )
        if len(groups) != layout.num_groups:
            raise ValueError(
                f"expected {layout.num_groups} block-id lists (one per KV cache group of "
                f"{layout.name or 'the layout'}), got {len(groups)}; pass [] for a group "
                "with no blocks"
            )
        arrays = []
        for g, ids in enumerate(groups):
            try:
                raw = np.asarray(ids)
            except (TypeError, ValueError, OverflowError) as exc:
                raise TypeError(f"group {g} block ids must be ints, got {ids!r}") from exc
            # check the kind before converting: a cast to int64 would silently truncate
            # floats (1.5 -> 1) and parse strings ("3" -> 3); bools are not block ids
            if raw.size and raw.dtype.kind not in "iu":
                raise TypeError(
                    f"group {g} block ids must be ints, got dtype {raw.dtype} ({ids!r})"
                )
            arrays.append(raw.astype(np.int64).reshape(-1))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        sizes = np.array([a.size for a in arrays], dtype=np.int64)
        _validate(flat, sizes, layout.num_blocks)
        self.flat = flat
        self.flat.setflags(write=False)
        self.group_sizes = sizes
        self.num_blocks = layout.num_blocks

    def group(self, g: int) -> np.ndarray:
        start = int(self.group_sizes[:g].sum())
        return self.flat[start : start + int(self.group_sizes[g])]

    @property
    def groups(self) -> list[list[int]]:
        return [self.group(g).tolist() for g in range(len(self.group_sizes))]

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    def unique_ids(self) -> np.ndarray:
        """Sorted non-null ids of the whole request (unique by validation)."""
        return np.sort(self.flat[self.flat != NULL_BLOCK])

    def __len__(self) -> int:
        return int(self.flat.size)

    def __repr__(self) -> str:
        return f"GroupedBlockIds(sizes={self.group_sizes.tolist()})"


def _validate(flat: np.ndarray, sizes: np.ndarray, num_blocks: int) -> None:
    if flat.size == 0:
        return
    bad = flat[(flat < 0) | (flat >= num_blocks)]
    if bad.size:
        kind = "negative" if bad.min() < 0 else "out of range"
        raise ValueError(
            f"block id {int(bad[0])} is {kind}: ids must be in [0, {num_blocks}) "
            f"(0 = null block); got {bad.size} bad id(s)"
        )
    real = flat[flat != NULL_BLOCK]
    uniq, counts = np.unique(real, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[counts > 1][0])
        owners = np.repeat(np.arange(sizes.size), sizes)[flat == dup]
        where = (
            f"twice in group {int(owners[0])}"
            if np.unique(owners).size == 1
            else f"in groups {sorted(set(owners.tolist()))}"
        )
        raise ValueError(
            f"block id {dup} appears {where}: non-null ids are unique across all groups "
            "(one shared BlockPool); only the null id 0 may repeat"
        )


def clip_to_window(groups: Sequence[Sequence[int]], layout: KVLayout) -> list[list[int]]:
    """Keep the last cdiv(window, block_size) + 1 ids of every sliding-window group
    (what vLLM exchanges); full-attention groups are kept whole."""
    if len(groups) != layout.num_groups:
        raise ValueError(f"expected {layout.num_groups} id lists, got {len(groups)}")
    out = []
    for ids, group in zip(groups, layout.groups, strict=True):
        spec = group.spec
        keep = spec.blocks_per_window if isinstance(spec, SlidingWindowSpec) else len(ids)
        out.append(list(ids)[-keep:] if keep else [])
    return out


def request_blocks(layout: KVLayout, num_tokens: int) -> list[int]:
    """Blocks each group holds for a prompt of ``num_tokens`` (SW groups clipped)."""
    return [g.spec.max_blocks_per_request(num_tokens) for g in layout.groups]
