"""READ bookkeeping of the decode role: remote/local id pairing, the request record.

`pair_blocks` pairs (remote ids, local ids), one list per group (the CLI's decode and the
vLLM connector's checksum both pair with it), `pair_runs` merges the pairs into block runs
``[R, 3]`` (src, dst, n); `RequestResult` is what `DecodeWorker` reports per request;
`Poster` posts the READ of runs. With ``prepared`` (`DecodeWorker(prepared_reads=True)`),
a block-major host buffer and a transport that prepares descriptor lists
(`NixlTransport.prepare`), one list of block rows per side is prepared once (ours at the
first READ, a remote's at its first READ after a handshake) and each READ names block
rows by index (``make_prepped_xfer``); otherwise, or if preparing fails, descriptor lists
are built per READ (``Transport.read``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstage.cache import HostBuffer, HostLayout
from kvstage.errors import InvalidRequest, LayoutMismatch
from kvstage.layout import KVLayout
from kvstage.plan import find_runs

if TYPE_CHECKING:
    from kvstage.pd.tp_copy import HostPart

DEFAULT_READ_TIMEOUT_S = 10.0
# RequestResult.code of failures that are not exceptions (else `errors.code_of`)
READ_TIMEOUT = "read_timeout"
READ_FAILED = "read_failed"
ABORTED = "aborted"
CHECKSUM_MISMATCH = "checksum_mismatch"  # the READ's bytes do not hash to prefill's digests
CHECKSUM_MISSING = "checksum_missing"  # verify_checksum here, prefill sent no digests


def finite_positive(name: str, value: float) -> float:
    """``value`` as a float, or InvalidRequest naming ``name`` unless finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        0 < value < float("inf")
    ):
        raise InvalidRequest(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Remote:
    """A handshaken prefill engine."""

    host: str
    port: int
    engine_id: str
    peer: str
    layout: KVLayout
    host_layout: HostLayout
    base: int
    lease_s: float


@dataclass
class RequestResult:
    request_id: str
    status: str  # "pending" | "done" | "failed" | "aborted"
    reason: str = ""  # for people
    code: str = ""  # for programs: READ_TIMEOUT, READ_FAILED, ABORTED or an errors code
    local_block_ids: list[list[int]] = field(default_factory=list)
    nbytes: int = 0
    num_descriptors: int = 0
    num_runs: int = 0
    read_s: float = 0.0  # READ posted -> last chunk's READ DONE
    h2d_s: float = 0.0  # copy time of the loads (overlapping the READ when pipelined)
    decode_s: float = 0.0  # READ posted -> last load done: what the pipeline shortens
    num_chunks: int = 0
    copy_ops: int = 0  # the h2d's copy calls

    @property
    def ok(self) -> bool:
        return self.status == "done"


@dataclass
class _Pending:
    result: RequestResult
    remote: Remote
    remote_request_id: str
    job: Any  # pipeline.ReadJob: the request's chunked READ
    started: float
    deadline: float
    capability: bytes = b""  # the request's token at prefill (Release carries it)


def pair_blocks(
    remote_ids: Sequence[Sequence[int]], local_ids: Sequence[Sequence[int]], *,
    lenient: bool = False,
) -> list[tuple[int, int, int]]:
    """(group, remote id, local id) of every block a READ moves, in order.

    Per group, the remote list is end-aligned to the local one (a shorter local list is a
    prefix decode already holds: vLLM's prefix trim, and how vLLM's own READ pairs them);
    null pairs are skipped. Strict (the CLI's decode, which chose its local ids): another
    number of groups, more local than remote blocks or a null paired with a real block is
    refused. ``lenient`` (the vLLM connector, checking what vLLM's READ already paired):
    the pairs zip from the end and any pair with a null side is skipped.
    """
    if not lenient and len(remote_ids) != len(local_ids):
        raise LayoutMismatch(
            f"remote has {len(remote_ids)} id lists, local {len(local_ids)}: one per group"
        )
    out = []
    for g, (r, loc) in enumerate(zip(remote_ids, local_ids, strict=not lenient)):
        if not lenient and len(loc) > len(r):
            raise InvalidRequest(
                f"group {g}: {len(loc)} local blocks for {len(r)} remote ones; decode can "
                "receive at most what prefill holds"
            )
        pairs = list(zip(reversed(list(r)), reversed(list(loc)), strict=False))[::-1]
        for a, b in pairs:
            if not lenient and (a == 0) != (b == 0):
                raise InvalidRequest(f"group {g}: null block paired with a real one ({a} -> {b})")
            if a and b:
                out.append((g, int(a), int(b)))
    return out


def pair_runs(
    remote_ids: Sequence[Sequence[int]], local_ids: Sequence[Sequence[int]]
) -> np.ndarray:
    """`pair_blocks` (strict) merged into runs ``[R, 3]`` (src, dst, n)."""
    pairs = pair_blocks(remote_ids, local_ids)
    return find_runs(np.array([a for _, a, _ in pairs], np.int64),
                     np.array([b for _, _, b in pairs], np.int64))


def blocks(runs: np.ndarray, col: int) -> np.ndarray:
    """Every block id of ``[R, 3]`` runs on side ``col`` (0 src, 1 dst), in order, int32."""
    n = runs[:, 2]
    first = np.repeat(runs[:, col] - (np.cumsum(n) - n), n)
    return (first + np.arange(int(n.sum()))).astype(np.int32)


class Poster:
    """Post READs of ``[R, 3]`` runs (src remote block, dst local block, n) for the decode."""

    def __init__(self, transport: Any, host: HostBuffer | HostPart,
                 prepared: bool = False) -> None:
        self.transport, self.host = transport, host
        self.prepared = prepared and host.block_major and hasattr(transport, "prepare")
        self._local: int | None = None
        self._remote: dict[tuple[str, int], int] = {}  # (peer, base) -> prepared list

    def _rows(self, base: int, num_blocks: int) -> np.ndarray:
        every = np.arange(num_blocks, dtype=np.int64)
        rows = self.host.descriptors(every, np.ones_like(every))
        rows[:, 0] += base - self.host.data_ptr
        return rows

    def remote_descs(self, remote: Remote, runs: np.ndarray) -> np.ndarray:
        # the remote buffer has our layout (checked at handshake): shift addresses only;
        # a block-major remote may hold another number of blocks (handshake.any_pool_size)
        end = runs[:, 0] + runs[:, 2]
        if end.size and int(end.max()) > remote.layout.num_blocks:
            raise InvalidRequest(
                f"remote block id {int(end.max()) - 1} is beyond the prefill's pool of "
                f"{remote.layout.num_blocks} blocks"
            )
        descs = self.host.descriptors(runs[:, 0], runs[:, 2])
        descs[:, 0] += remote.base - self.host.data_ptr
        return descs

    def post(self, remote: Remote, runs: np.ndarray, notif: bytes) -> int:
        key = (remote.peer, remote.base)
        if self.prepared and key not in self._remote:
            try:
                if self._local is None:
                    mine = self._rows(self.host.data_ptr, self.host.layout.num_blocks)
                    self._local = self.transport.prepare(None, mine)
                theirs = self._rows(remote.base, remote.layout.num_blocks)
                self._remote[key] = self.transport.prepare(remote.peer, theirs)
            except Exception:  # the READ itself reports what is wrong (e.g. NOT_FOUND)
                pass
        if self._local is None or key not in self._remote:
            return int(self.transport.read(
                remote.peer, self.host.descriptors(runs[:, 1], runs[:, 2]),
                self.remote_descs(remote, runs), notif))
        return int(self.transport.read_prepared(remote.peer, self._local, blocks(runs, 1),
                                                self._remote[key], blocks(runs, 0), notif))
