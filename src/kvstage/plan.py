"""Pure planning: block ids -> contiguous runs -> budgeted chunks -> counts.

Runs come from the ids' sorted unique non-null ids, which validation already produced:
with a plain Python loop for small requests (one contiguous run is O(1)), with one numpy
diff for large ones; no numpy round trip for a small request. Everything a direct copy
does not need (block_ids as an array, pieces, chunks, owned slots) is built on first use.

The same `CopyPlan` serves d2h and h2d (device and host use the same block ids). Every
physical tensor moves the request's whole id set: that keeps one op per run over the
slab and one network descriptor per run in the block-major host layout. Slots of a
tensor that no layer of a group owns (short groups: gemma-3-1b groups 4 and 5 have no
layer in tensor 3) are copied too; no layer reads them, so that costs bytes only
(`padding_bytes`), never correctness.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from kvstage.blocks import NULL_BLOCK, SMALL_IDS, GroupedBlockIds
from kvstage.layout import KVLayout

DEFAULT_MAX_TEMP_BYTES = 8 << 20
INDEX_BYTES = 8  # one int64 index per gathered block


def find_runs(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Merge (src, dst) block pairs into runs where both advance by one.

    Returns int64 ``[num_runs, 3]`` rows of (src_start, dst_start, length), in dst order.
    ``[3,4,5,9] -> [3,4,5,9]`` gives ``[[3,3,3],[9,9,1]]``.
    """
    src = np.asarray(src, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"src has {src.size} ids, dst has {dst.size}; they pair one to one")
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    order = np.argsort(dst, kind="stable")
    src, dst = src[order], dst[order]
    breaks = np.flatnonzero((np.diff(dst) != 1) | (np.diff(src) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [dst.size])))
    return np.stack((src[starts], dst[starts], lengths), axis=1)


def _runs_of_sorted(ids: np.ndarray) -> np.ndarray:
    """Runs of a sorted, non-empty id array copied onto itself (the engine's case: device
    and host share block ids): one diff, no argsort, no pairing."""
    is_start = np.empty(ids.size, dtype=bool)
    is_start[0] = True
    np.not_equal(ids[1:] - ids[:-1], 1, out=is_start[1:])
    starts = np.flatnonzero(is_start)
    lengths = np.empty_like(starts)
    lengths[:-1] = starts[1:] - starts[:-1]
    lengths[-1] = ids.size - starts[-1]
    runs = np.empty((starts.size, 3), dtype=np.int64)
    runs[:, 0] = runs[:, 1] = ids[starts]
    runs[:, 2] = lengths
    return runs


def split_runs(runs: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut runs so that every chunk holds at most ``max_len`` blocks.

    Returns (pieces ``[P, 4]`` of (src_start, dst_start, length, offset_in_chunk), and
    chunk bounds ``[C, 2]`` of (first_piece, end_piece)). Blocks are taken in run order,
    so chunk k covers blocks [k * max_len, (k + 1) * max_len) of the request.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if runs.shape[0] == 0:
        return np.zeros((0, 4), np.int64), np.zeros((0, 2), np.int64)
    ends = np.cumsum(runs[:, 2])
    total = int(ends[-1])
    first = ends - runs[:, 2]  # request offset of each run
    if total <= max_len:  # one chunk (the common case): the runs are the pieces
        pieces = np.concatenate((runs, first[:, None]), axis=1)
        return pieces, np.array([[0, runs.shape[0]]], dtype=np.int64)
    cuts = np.arange(max_len, total, max_len)
    # every run boundary and chunk boundary, as request offsets
    edges = np.union1d(np.concatenate((first, cuts)), [total])
    starts = edges[:-1]
    lengths = np.diff(edges)
    run_of = np.searchsorted(first, starts, side="right") - 1
    delta = starts - first[run_of]
    pieces = np.stack(
        (runs[run_of, 0] + delta, runs[run_of, 1] + delta, lengths, starts % max_len), axis=1
    )
    chunk_of = starts // max_len
    bounds = np.searchsorted(chunk_of, np.arange(chunk_of[-1] + 2))
    return pieces, np.stack((bounds[:-1], bounds[1:]), axis=1)


def _run_list(ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs ``(start, start, length)`` of sorted unique ids, in plain Python: for small
    requests this beats numpy's per-call costs, and one contiguous run costs O(1)."""
    n = len(ids)
    if n == 0:
        return []
    start = prev = ids[0]
    if ids[-1] - start + 1 == n:  # sorted and unique: the span equals the count
        return [(start, start, n)]
    runs = []
    for i in itertools.islice(ids, 1, None):
        if i != prev + 1:
            runs.append((start, start, prev - start + 1))
            start = i
        prev = i
    runs.append((start, start, prev - start + 1))
    return runs


def runs_of_ids(ids: Sequence[int]) -> list[tuple[int, int, int]] | np.ndarray:
    """Runs ``(start, start, n)`` of one flat list of an engine's own ids copied onto
    themselves (device and host share ids): the runs `plan_copy` makes from
    ``GroupedBlockIds(..., trusted=True)``, without building either object (a small
    request's copy is a few us; those two cost about as much again). Sorted unique
    non-null ids; no checks: for ids the engine's allocator produced. A list of tuples
    up to `SMALL_IDS` ids, else int64 ``[R, 3]``."""
    if len(ids) <= SMALL_IDS:
        real = set(ids)
        real.discard(NULL_BLOCK)
        return _run_list(sorted(real))
    arr = np.unique(np.asarray(ids, dtype=np.int64))
    arr = arr[arr != NULL_BLOCK]
    return _runs_of_sorted(arr) if arr.size else []


class CopyPlan:
    """What one request moves between device and host, for every physical tensor.

    ``run_list``: the runs as ``(src_start, dst_start, length)`` tuples (what the engine
    dispatches); ``runs``: the same as int64 ``[num_runs, 3]``.
    ``block_ids``: sorted unique non-null ids, int64 ``[num_blocks]``.
    ``pieces``/``chunks``: the runs cut under ``max_temp_bytes`` for staged gathers.
    Everything but the runs is computed on first use (a direct copy, the CPU path, needs
    only ``run_list``). Two plans are equal when they move the same blocks of the same
    layout under the same budget and own the same slots.
    """

    __slots__ = ("layout", "max_temp_bytes", "num_blocks", "_ids", "_run_list", "_runs",
                 "_split", "_owned")

    def __init__(
        self,
        layout: KVLayout,
        ids: GroupedBlockIds,
        max_temp_bytes: int,
        runs: list[tuple[int, int, int]] | np.ndarray,
        num_blocks: int,
    ) -> None:
        self.layout = layout
        self.max_temp_bytes = max_temp_bytes
        self.num_blocks = num_blocks
        self._ids = ids
        if isinstance(runs, list):
            self._run_list: list[tuple[int, int, int]] | None = runs
            self._runs: np.ndarray | None = None
        else:
            self._run_list, self._runs = None, runs
        self._split: tuple[np.ndarray, np.ndarray] | None = None
        self._owned: int | None = None

    @property
    def run_list(self) -> list[tuple[int, int, int]]:
        if self._run_list is None:
            assert self._runs is not None
            self._run_list = [(s, d, n) for s, d, n in self._runs.tolist()]
        return self._run_list

    @property
    def runs(self) -> np.ndarray:
        """int64 ``[num_runs, 3]`` (src_start, dst_start, length)."""
        if self._runs is None:
            self._runs = np.array(self._run_list, dtype=np.int64).reshape(-1, 3)
        return self._runs

    @property
    def block_ids(self) -> np.ndarray:
        return self._ids.unique_ids()

    @property
    def chunk_blocks(self) -> int:
        """Blocks per staging chunk: max(1, budget // (block_bytes + 8))."""
        return max(1, self.max_temp_bytes // (self.layout.block_bytes + INDEX_BYTES))

    @property
    def owned_slots(self) -> int:
        """(tensor, block) slots some layer owns: a group's real ids count once per layer
        the group has."""
        if self._owned is None:
            layers = np.repeat(np.asarray(self.layout.layers_per_group), self._ids.group_sizes)
            self._owned = int(layers[self._ids.flat != NULL_BLOCK].sum())
        return self._owned

    def _pieces_chunks(self) -> tuple[np.ndarray, np.ndarray]:
        if self._split is None:
            self._split = split_runs(self.runs, self.chunk_blocks)
        return self._split

    @property
    def pieces(self) -> np.ndarray:
        """``[P, 4]`` (src_start, dst_start, length, offset_in_chunk)."""
        return self._pieces_chunks()[0]

    @property
    def chunks(self) -> np.ndarray:
        """``[C, 2]`` (first_piece, end_piece) per staging chunk."""
        return self._pieces_chunks()[1]

    @property
    def num_runs(self) -> int:
        return len(self._run_list) if self._run_list is not None else int(self.runs.shape[0])

    @property
    def num_chunks(self) -> int:
        """Staging chunks: chunk k holds blocks [k * chunk_blocks, (k + 1) * chunk_blocks)."""
        return -(-self.num_blocks // self.chunk_blocks)

    @property
    def is_empty(self) -> bool:
        return self.num_blocks == 0

    @property
    def nbytes(self) -> int:
        """Bytes moved per direction: blocks x tensors x page."""
        return self.num_blocks * self.layout.block_bytes

    @property
    def staging_bytes(self) -> int:
        """Largest staging temporary (+ its index) a staged gather allocates."""
        rows = min(self.chunk_blocks, self.num_blocks)
        return rows * (self.layout.block_bytes + INDEX_BYTES)

    @property
    def padding_bytes(self) -> int:
        return self.nbytes - self.owned_bytes

    @property
    def owned_bytes(self) -> int:
        """Bytes of (tensor, block) slots some layer owns: the true minimum."""
        return self.owned_slots * self.layout.page_size_bytes

    def num_descriptors(self, block_major: bool) -> int:
        """Network descriptors for this plan: one per run (block-major host rows hold
        every tensor of a block), else one per run per tensor per plane."""
        if block_major:
            return self.num_runs
        return self.num_runs * self.layout.num_tensors * self.layout.num_planes

    def summary(self) -> dict[str, int]:
        return {
            "blocks": self.num_blocks,
            "runs": self.num_runs,
            "chunks": self.num_chunks,
            "bytes": self.nbytes,
            "owned_bytes": self.owned_bytes,
            "staging_bytes": self.staging_bytes,
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CopyPlan):
            return NotImplemented
        return (
            self.layout == other.layout
            and self.max_temp_bytes == other.max_temp_bytes
            and self.run_list == other.run_list
            and self.owned_slots == other.owned_slots
        )

    __hash__ = None  # type: ignore[assignment]  # equal plans, different ids objects

    def __repr__(self) -> str:
        return (f"CopyPlan(blocks={self.num_blocks}, runs={self.num_runs}, "
                f"bytes={self.nbytes}, max_temp_bytes={self.max_temp_bytes})")


def plan_copy(
    layout: KVLayout, ids: GroupedBlockIds, *, max_temp_bytes: int = DEFAULT_MAX_TEMP_BYTES
) -> CopyPlan:
    """Plan one request's d2h or h2d copy.

    ``max_temp_bytes`` bounds the staging temporary of a gather: a chunk holds
    max(1, budget // (block_bytes + 8)) blocks (gemma-3-1b, 4 tensors x 16 KiB pages,
    8 MiB -> 127 blocks), so peak extra memory is flat in the request size. The runs
    come from the ids' sorted unique non-null ids (a by-product of validation): in
    Python for small requests, with one numpy diff for large ones.
    """
    if type(ids) is not GroupedBlockIds and not isinstance(ids, GroupedBlockIds):
        raise TypeError(f"expected GroupedBlockIds, got {type(ids).__name__}")
    if ids.num_blocks != layout.num_blocks or ids.num_groups != layout.num_groups:
        raise ValueError(
            f"ids were validated for {ids.num_groups} groups x {ids.num_blocks} blocks, "
            f"the layout has {layout.num_groups} x {layout.num_blocks}; rebuild them for it"
        )
    if type(max_temp_bytes) is not int or max_temp_bytes <= 0:
        raise ValueError(f"max_temp_bytes must be a positive int, got {max_temp_bytes!r}")
    sorted_ids = ids.sorted_ids()
    num_blocks = len(sorted_ids)
    runs: list[tuple[int, int, int]] | np.ndarray
    if isinstance(sorted_ids, list):
        runs = _run_list(sorted_ids)
    elif num_blocks and int(sorted_ids[-1]) - int(sorted_ids[0]) + 1 == num_blocks:
        first = int(sorted_ids[0])
        runs = [(first, first, num_blocks)]
    else:
        runs = _runs_of_sorted(sorted_ids) if num_blocks else []
    return CopyPlan(layout, ids, max_temp_bytes, runs, num_blocks)
