"""Decode's local block ids: who may write each one, and the quarantine of late bytes.

`LocalIds` is the decode role's record of its local ids (= its host rows: block-major
host row b is device block b): which request's READ may write each id (``in_flight``),
the ids the worker's `BlockPool` hands out (``claim``), and the quarantine: the ids of a
READ that ended without being seen over (timed out, aborted, or a handle the transport
would not release) stay in flight, with their handles, until ``retry`` sees every handle
DONE, FAILED or gone; only then do they go back (why: decode.py's module doc).

Thread rules: the decode's one thread (it calls the transport's poll/release).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvstage.blocks import BlockPool, GroupedBlockIds
from kvstage.errors import InvalidRequest, PoolExhausted
from kvstage.layout import KVLayout
from kvstage.pd.reads import pair_runs
from kvstage.transport.base import TransferState, Transport

Ids = list[list[int]]


class LocalIds:
    def __init__(self, layout: KVLayout, pool: BlockPool | None, transport: Transport) -> None:
        self.layout, self.pool, self.transport = layout, pool, transport
        self.in_flight: dict[int, str] = {}  # local block id -> who may write it
        # quarantined: first handle -> (handles, ids to give back to the pool, local ids)
        self.draining: dict[int, tuple[list[int], Ids, Ids]] = {}

    def claim(self, remote_ids: Sequence[Sequence[int]],
              local_block_ids: Sequence[Sequence[int]] | None) -> tuple[Ids, bool]:
        """The request's local ids, checked: (ids, allocated here)."""
        if local_block_ids is None:
            if self.pool is None:
                raise InvalidRequest(
                    "local_block_ids is required: this decode worker has no BlockPool "
                    "(the engine allocates the ids)"
                )
            counts = [len(g) for g in remote_ids]
            if sum(counts) > self.pool.num_free:
                raise PoolExhausted(
                    f"request needs {sum(counts)} local blocks, {self.pool.num_free} are free"
                )
            return [self.pool.allocate(n) for n in counts], True
        local = [list(g) for g in local_block_ids]
        GroupedBlockIds(local, self.layout)  # shape, range and duplicate checks
        pair_runs(remote_ids, local)  # pairing checks before ownership checks
        busy = sorted({b for g in local for b in g if b and b in self.in_flight})
        if busy:
            raise InvalidRequest(
                f"local blocks {busy[:8]} are in flight for request "
                f"{self.in_flight[busy[0]]!r}; a block may receive one READ at a time"
            )
        if self.pool is not None:
            free = sorted({b for g in local for b in g if b and self.pool.is_free(b)})
            if free:
                raise InvalidRequest(
                    f"local blocks {free[:8]} were not allocated from this worker's pool "
                    "(it would hand them out again); allocate them from decode.pool first"
                )
        return local, False

    def mark(self, local: Ids, who: str) -> None:
        for g in local:
            for b in g:
                if b:
                    self.in_flight[b] = who

    def still_pending(self, handle: int) -> bool:
        try:
            return self.transport.poll(handle) is TransferState.PENDING
        except InvalidRequest:
            return False
        except Exception:
            return True  # cannot tell: assume it may write

    def quarantine(self, open_: list[int], over: list[int], owned: Ids | None,
                   local: Ids) -> None:
        """Keep ``open_`` handles and the ids until every one is over; release ``over``."""
        for h in over:
            with contextlib.suppress(Exception):
                self.transport.release(h)
        self.draining[open_[0]] = (open_, owned or [], local)
        self.mark(local, f"quarantined READ (handle {open_[0]})")

    def release(self, handles: list[int], owned: Ids | None, local: Ids) -> None:
        """Release handles, then let the ids go (back to the pool when the worker allocated
        them); handles the transport refuses keep them all quarantined."""
        refused = []
        for h in handles:
            try:
                self.transport.release(h)
            except InvalidRequest:
                pass  # already gone
            except Exception:
                refused.append(h)
        if refused:
            self.quarantine(refused, [], owned, local)
            return
        self.unmark(local)
        if owned:
            self.free(owned)

    def end(self, handles: list[int], open_: list[int], owned: Ids | None,
            local: Ids) -> None:
        """A failed request: quarantine while any of ``open_`` may write, else release."""
        open_ = [h for h in open_ if self.still_pending(h)]
        if open_:
            self.quarantine(open_, [h for h in handles if h not in open_], owned, local)
        else:
            self.release(handles, owned, local)

    def unmark(self, local: Ids) -> None:
        for g in local:
            for b in g:
                self.in_flight.pop(b, None)

    def free(self, ids: Ids) -> None:
        assert self.pool is not None  # only ids the pool allocated are freed here
        for g in ids:
            self.pool.free(g)

    def retry(self) -> None:
        """Let quarantined ids go once every transfer on them is over (DONE/FAILED/gone)."""
        for key, (handles, owned, local) in list(self.draining.items()):
            if any(self.still_pending(h) for h in handles):
                continue
            del self.draining[key]
            self.release(handles, owned, local)

    def drop_all(self) -> None:
        """The transport is closed: no READ of it writes any more, let everything go."""
        for key in list(self.draining):
            _, owned, local = self.draining.pop(key)
            self.unmark(local)
            if owned:
                self.free(owned)
