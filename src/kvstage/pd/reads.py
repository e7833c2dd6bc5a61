"""READ bookkeeping of the decode role: remote/local id pairing, the request record.

`pair_runs` turns (remote ids, local ids), one list per group, into merged block runs
``[R, 3]`` (src, dst, n); `RequestResult` is what `DecodeWorker` reports per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstage.cache import HostLayout
from kvstage.errors import InvalidRequest, LayoutMismatch
from kvstage.layout import KVLayout
from kvstage.plan import find_runs

DEFAULT_READ_TIMEOUT_S = 10.0
# RequestResult.code of failures that are not exceptions (else `errors.code_of`)
READ_TIMEOUT = "read_timeout"
READ_FAILED = "read_failed"
ABORTED = "aborted"
CHECKSUM_MISMATCH = "checksum_mismatch"  # the READ's bytes do not hash to prefill's digests
CHECKSUM_MISSING = "checksum_missing"  # verify_checksum here, prefill sent no digests


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


def pair_runs(
    remote_ids: Sequence[Sequence[int]], local_ids: Sequence[Sequence[int]]
) -> np.ndarray:
    """Pair remote and local ids group by group and merge into runs ``[R, 3]``.

    A local list shorter than the remote one is a prefix decode already holds: the
    remote list is end-aligned to it (vLLM's prefix trim). Null pairs are skipped.
    """
    if len(remote_ids) != len(local_ids):
        raise LayoutMismatch(
            f"remote has {len(remote_ids)} id lists, local {len(local_ids)}: one per group"
        )
    src, dst = [], []
    for g, (r, loc) in enumerate(zip(remote_ids, local_ids, strict=True)):
        if len(loc) > len(r):
            raise InvalidRequest(
                f"group {g}: {len(loc)} local blocks for {len(r)} remote ones; decode can "
                "receive at most what prefill holds"
            )
        r = list(r)[len(r) - len(loc) :]
        for a, b in zip(r, loc, strict=True):
            if (a == 0) != (b == 0):
                raise InvalidRequest(f"group {g}: null block paired with a real one ({a} -> {b})")
            if a:
                src.append(a)
                dst.append(b)
    return find_runs(np.array(src, np.int64), np.array(dst, np.int64))
