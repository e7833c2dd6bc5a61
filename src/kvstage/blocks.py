"""Block ids: one pool shared by every KV cache group, and a request's per-group ids.

All groups allocate from one `BlockPool`, so a non-null id is held by at most one group
of one request; id 0 is the null block (sliding-window padding) and is never copied.
"""

from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

from kvstage.errors import PoolExhausted
from kvstage.layout import KVLayout, MambaSpec, SlidingWindowSpec

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

    Held as the ids concatenated group after group (``flat``: int64 ``[num_ids]``) plus
    per-group sizes (``group_sizes``: int64 ``[num_groups]``), the vLLM kv_offload shape;
    both are built on first use. `sorted_ids` (sorted unique non-null ids) is a by-product
    of validation.

    Refused, each with a message naming the group: a wrong number of groups, a flat list
    of ids where a list per group is expected, nested lists inside a group, ids that are
    not ints (floats, strings, None, bools), ids outside ``[0, num_blocks)``, and a non-null
    id held twice (in one group or across groups). Lists of Python ints are checked with
    ``set``/``sorted`` (no per-id Python bytecode) when small and with numpy when large;
    anything that quick check does not accept goes through the full check, which raises
    (or accepts, e.g. numpy integers in a list) with the same rules.

    ``trusted=True`` skips the per-id checks (the group count and the container types
    are still checked): for ids the engine's own allocator handed out (vLLM's scheduler,
    a `BlockPool`). Ids that break the rules then give undefined results.
    """

    __slots__ = ("num_blocks", "_ids", "_sizes", "_flat", "_group_sizes", "_sorted", "_unique")

    def __init__(
        self, groups: Sequence[Sequence[int]], layout: KVLayout, *, trusted: bool = False
    ) -> None:
        num_blocks = layout.num_blocks
        self.num_blocks = num_blocks
        self._flat: np.ndarray | None = None
        self._group_sizes: np.ndarray | None = None
        self._sorted: list[int] | np.ndarray | None = None
        self._unique: np.ndarray | None = None
        self._ids: list[int] | None = None
        joined = _join_lists(groups)
        if joined is not None and len(joined[1]) == layout.num_groups:
            self._ids, self._sizes = joined
            if trusted:
                return
            checked = _check_ints(self._ids, num_blocks)
            if checked is not None:
                self._sorted, self._flat = checked
                if self._flat is not None:
                    self._flat.setflags(write=False)
                return
        arrays = _arrays(groups, layout)  # the full check: refuses with a message
        flat = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        if not trusted:
            self._sorted = _validate(flat, np.array([a.size for a in arrays]), num_blocks)
        self._ids = None
        self._sizes = [a.size for a in arrays]
        flat.setflags(write=False)
        self._flat = flat

    @property
    def flat(self) -> np.ndarray:
        """Read-only int64 ``[num_ids]``: every group's ids, group after group."""
        if self._flat is None:
            flat = np.array(self._ids, dtype=np.int64).reshape(-1)
            flat.setflags(write=False)
            self._flat = flat
        return self._flat

    @property
    def group_sizes(self) -> np.ndarray:
        """Read-only int64 ``[num_groups]``: ids per group (null ids included)."""
        if self._group_sizes is None:
            sizes = np.array(self._sizes, dtype=np.int64)
            sizes.setflags(write=False)
            self._group_sizes = sizes
        return self._group_sizes

    def group(self, g: int) -> np.ndarray:
        start = sum(self._sizes[:g])
        return self.flat[start : start + self._sizes[g]]

    @property
    def groups(self) -> list[list[int]]:
        return [self.group(g).tolist() for g in range(len(self._sizes))]

    @property
    def num_groups(self) -> int:
        return len(self._sizes)

    def sorted_ids(self) -> list[int] | np.ndarray:
        """Sorted unique non-null ids ``[num_blocks_moved]``: a list of ints for small
        list inputs, else an int64 array (what the planner takes either way)."""
        if self._sorted is None:
            if self._ids is not None and len(self._ids) <= SMALL_IDS:
                real = set(self._ids)
                real.discard(NULL_BLOCK)
                self._sorted = sorted(real)
            else:
                self._sorted = np.unique(self.flat[self.flat != NULL_BLOCK])
        return self._sorted

    def unique_ids(self) -> np.ndarray:
        """Sorted non-null ids of the whole request (unique by validation): read-only int64
        ``[num_blocks_moved]``."""
        if self._unique is None:
            ids = self.sorted_ids()
            unique = np.array(ids, dtype=np.int64) if isinstance(ids, list) else ids
            unique.setflags(write=False)
            self._unique = unique
        return self._unique

    def __len__(self) -> int:
        return len(self._ids) if self._ids is not None else int(self.flat.size)

    def __repr__(self) -> str:
        return f"GroupedBlockIds(sizes={list(self._sizes)})"


# Up to this many ids, ``set`` + ``sorted`` over Python ints beat numpy's per-call costs;
# above it numpy's sort wins (BENCHMARKS.md, "What does each request cost beyond its bytes?").
SMALL_IDS = 256


def _join_lists(groups: object) -> tuple[list[int], list[int]] | None:
    """(ids concatenated, sizes) when ``groups`` and every group are lists or tuples."""
    if type(groups) is not list and type(groups) is not tuple:
        return None
    flat: list[int] = []
    sizes = []
    for ids in groups:
        if type(ids) is not list and type(ids) is not tuple:
            return None
        flat += ids
        sizes.append(len(ids))
    return flat, sizes


def _check_ints(
    flat: list[int], num_blocks: int
) -> tuple[list[int] | np.ndarray, np.ndarray | None] | None:
    """(sorted unique non-null ids, the flat array if one was built) when ``flat`` is
    valid Python ints, else None (the full check decides and names the problem)."""
    n = len(flat)
    if n == 0:
        return [], None
    if set(map(type, flat)) != {int}:  # bools, floats, nested lists, numpy ints ...
        return None
    if n <= SMALL_IDS:
        real = set(flat)
        real.discard(NULL_BLOCK)
        if len(real) != n - flat.count(NULL_BLOCK):
            return None  # a repeated non-null id
        ids = sorted(real)
        if ids and (ids[0] < 0 or ids[-1] >= num_blocks):
            return None
        return ids, None
    try:
        arr = np.array(flat, dtype=np.int64)
    except OverflowError:
        return None
    real_arr = arr[arr != NULL_BLOCK]
    real_arr.sort()
    if real_arr.size and (
        real_arr[0] < 0 or real_arr[-1] >= num_blocks or bool((real_arr[1:] == real_arr[:-1]).any())
    ):
        return None
    return real_arr, arr


def _arrays(groups: object, layout: KVLayout) -> list[np.ndarray]:
    """Every group as an int64 ``[n]`` array, refusing what is not a list of int ids."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise TypeError(
            f"block ids must be a sequence of per-group id lists, got {type(groups).__name__}"
        )
    if any(isinstance(x, (numbers.Integral, np.integer)) for x in groups):
        raise TypeError(
            f"block ids must be one list per KV cache group, got a flat list of ids "
            f"{_short(groups)}; pass [[...], [...]] ({layout.num_groups} lists, [] for a "
            "group with no blocks)"
        )
    if len(groups) != layout.num_groups:
        raise ValueError(
            f"expected {layout.num_groups} block-id lists (one per KV cache group of "
            f"{layout.name or 'the layout'}), got {len(groups)}; pass [] for a group "
            "with no blocks"
        )
    arrays = []
    for g, ids in enumerate(groups):
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, np.ndarray)):
            raise TypeError(
                f"group {g} block ids must be ints in a list, got {type(ids).__name__} "
                f"{_short(ids)}"
            )
        if isinstance(ids, Sequence) and any(isinstance(x, (Sequence, np.ndarray)) and
                                             not isinstance(x, (str, bytes)) for x in ids):
            raise TypeError(
                f"group {g} holds a nested list {_short(ids)}: each group is one flat list "
                "of int ids"
            )
        if isinstance(ids, Sequence) and any(isinstance(x, (bool, np.bool_)) for x in ids):
            raise TypeError(
                f"group {g} block ids must be ints, got a bool in {_short(ids)}: True and "
                "False are not block ids"
            )
        try:
            raw = np.asarray(ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"group {g} block ids must be ints, got {_short(ids)}") from exc
        if raw.ndim != 1:
            raise TypeError(
                f"group {g} block ids must be a flat 1-D list of ints, got an array of "
                f"shape {raw.shape}"
            )
        # check the kind before converting: a cast to int64 would silently truncate
        # floats (1.5 -> 1) and parse strings ("3" -> 3); bools are not block ids
        if raw.size and raw.dtype.kind not in "iu":
            raise TypeError(
                f"group {g} block ids must be ints, got dtype {raw.dtype} ({_short(ids)})"
            )
        arrays.append(raw.astype(np.int64))
    return arrays


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _validate(flat: np.ndarray, sizes: np.ndarray, num_blocks: int) -> np.ndarray:
    """Range and uniqueness of ``flat``; returns its sorted unique non-null ids."""
    if flat.size == 0:
        return flat
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
    return uniq


def clip_to_window(groups: Sequence[Sequence[int]], layout: KVLayout) -> list[list[int]]:
    """Keep the last cdiv(window, block_size) + 1 ids of every sliding-window group and
    the running-state slot of every state group (the last id before the speculative
    scratch slots), as vLLM exchanges them; full-attention groups are kept whole."""
    if len(groups) != layout.num_groups:
        raise ValueError(f"expected {layout.num_groups} id lists, got {len(groups)}")
    out = []
    for ids, group in zip(groups, layout.groups, strict=True):
        spec = group.spec
        if isinstance(spec, MambaSpec):
            scratch = min(spec.num_speculative_blocks, max(len(ids) - 1, 0))
            out.append(list(ids)[: len(ids) - scratch][-1:])
            continue
        keep = spec.blocks_per_window if isinstance(spec, SlidingWindowSpec) else len(ids)
        out.append(list(ids)[-keep:] if keep else [])
    return out


def request_blocks(layout: KVLayout, num_tokens: int) -> list[int]:
    """Blocks each group holds for a prompt of ``num_tokens`` (SW groups clipped)."""
    return [g.spec.max_blocks_per_request(num_tokens) for g in layout.groups]
