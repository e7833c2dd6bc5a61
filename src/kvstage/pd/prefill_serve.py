"""The prefill role's side channel: what `PrefillWorker` answers to each message.

`handle(worker, msg)` answers GetMeta (the handshake: agent metadata, layout, host buffer,
and across TP sizes the slices it holds: `kvstage.pd.tp_parts`), PrefillRequest (a
producer's prompt), Acquire (the lease renewed, the checksums of the slice the decode
reads), Release and GetStats; `authorized` finds a held request by its capability.
Called on the worker's serving thread only (the worker's thread rules).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from kvstage.blocks import BlockPool
from kvstage.errors import InvalidRequest, NotHeld, Unauthorized
from kvstage.layout import KVLayout
from kvstage.pd import auth, lease
from kvstage.pd import messages as m
from kvstage.pd.prefill_state import PrefillCounters, SavedRequest
from kvstage.pd.tp_parts import TPSide
from kvstage.transport.base import Transport

__all__ = ["PrefillWorker", "authorized", "handle", "stats"]


class PrefillWorker(Protocol):
    """What the answers read of `kvstage.pd.prefill.PrefillWorker` (no import: no cycle)."""

    engine_id: str
    transport: Transport
    agent_metadata: bytes
    layout: KVLayout
    host: Any  # HostBuffer
    lease_s: float
    max_hold_s: float
    tp: TPSide | None
    pool: BlockPool | None
    counters: PrefillCounters
    _requests: dict[str, SavedRequest]

    @property
    def num_slices(self) -> int: ...
    @property
    def num_held(self) -> int: ...
    @property
    def held_blocks(self) -> int: ...
    def prefill(self, request_id: str, num_tokens: int, seed: int) -> m.PrefillDone: ...
    def release(self, request_id: str) -> None: ...
    def _free(self, request_id: str) -> bool: ...
    def _authorized(self, request_id: str, capability: bytes) -> SavedRequest: ...
    def stats(self) -> m.Stats: ...
    def _checksums(self, req: SavedRequest, slice_index: int = 0) -> list[list[int]]: ...


def handle(w: PrefillWorker, msg: m.Message) -> m.Message:
    if isinstance(msg, m.GetMeta):
        tp = w.tp
        return m.Meta(
            engine_id=w.engine_id,
            agent_name=w.transport.name,
            agent_metadata=w.agent_metadata,
            layout=m.layout_to_msg(w.layout),
            host_layout=w.host.host_layout.value,
            host_base=w.host.data_ptr,
            host_nbytes=w.host.nbytes,
            lease_s=w.lease_s,
            tp_size=tp.size if tp else 0,
            tp_rank=tp.rank if tp else 0,
            peer_tp_size=tp.peer_size if tp else 0,
            num_slices=tp.parts.num_parts if tp else 1,
            parts=tp.parts.signature() if tp else "",
        )
    if isinstance(msg, m.PrefillRequest):
        return w.prefill(msg.request_id, msg.num_tokens, msg.seed)
    if isinstance(msg, m.Acquire):
        req = w._authorized(msg.request_id, msg.capability)
        if not 0 <= msg.slice_index < w.num_slices:
            raise InvalidRequest(f"slice_index {msg.slice_index} out of range: this prefill "
                                 f"holds {w.num_slices} slice(s) per block")
        now = time.monotonic()
        if lease.expired(req.deadline, now):  # at max_hold_s (or not swept yet): it ends now
            w._free(msg.request_id)
            w.counters.expired += 1
            raise NotHeld(
                f"request {msg.request_id[:64]!r} reached its lease end (held at most "
                f"{w.max_hold_s:g} s)"
            )
        # like vLLM's heartbeats: a decode about to READ extends the lease, within the
        # bound on the total hold
        req.deadline = lease.deadline(now, w.lease_s, req.hold_until)
        return m.Lease(request_id=msg.request_id, remaining_s=req.deadline - now,
                       engine_id=w.engine_id, checksums=w._checksums(req, msg.slice_index))
    if isinstance(msg, m.Release):
        w._authorized(msg.request_id, msg.capability)
        w.release(msg.request_id)
        return m.Ok()
    if isinstance(msg, m.GetStats):
        return w.stats()
    raise InvalidRequest(f"prefill worker does not handle {type(msg).__name__}")


def authorized(w: PrefillWorker, request_id: str, capability: bytes) -> SavedRequest:
    """The held request, if ``capability`` is the one issued for it (the worker's
    ``_authorized``: `handle` calls that method, the one place a capability is judged)."""
    req = w._requests.get(request_id)
    if req is None or not req.held:
        raise NotHeld(
            f"request {request_id[:64]!r} is not held here (never prefilled, "
            "already read, released, or its lease expired)"
        )
    if not auth.same_capability(capability, req.capability):
        w.counters.bad_capability += 1
        raise Unauthorized(
            f"wrong or missing capability for request {request_id[:64]!r}: pass the "
            "one prefill issued with its block ids (PrefillDone.capability)"
        )
    return req


def stats(w: PrefillWorker) -> m.Stats:
    c = w.counters
    return m.Stats(
        held_requests=w.num_held,
        held_blocks=w.held_blocks,
        free_blocks=w.pool.num_free if w.pool is not None else -1,
        prefilled=c.prefilled,
        completed=c.completed,
        released=c.released,
        expired=c.expired,
        unknown_notifs=list(c.unknown_notifs),
        open_handles=w.transport.num_open_handles,
        num_unknown_notifs=c.num_unknown_notifs,
        unauthorized=c.unauthorized,
        bad_capability=c.bad_capability,
    )
