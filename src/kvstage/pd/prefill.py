"""PrefillWorker: the prefill role. KV the engine wrote -> host buffer -> served to decode.

Primitives (what an engine calls):
- ``save(request_id, block_ids, wait=True)``: d2h of blocks whose KV the engine has
  written. May be called once per prefill step (chunked prefill): ids already saved for
  the request are copied again (the last, partly filled block of a chunk is completed by
  the next), new ones are added to the request. ``wait=False`` queues the copy
  (`kvstage.pd.saves`: a CUDA copy stream, or a CPU thread) so it overlaps the engine's
  next chunk; ``hold`` waits for it (and raises a copy's error: then ``release``).
- ``hold(request_id)``: the request is complete; its blocks are held under a lease
  (default 30 s, renewable by Acquire up to ``max_hold_s`` in total, default 4 leases)
  and decode may READ them. Returns the ids and the request's capability (an
  unguessable token) to hand to decode: a side-channel Acquire or Release and the
  completion notification are honoured only with it (`kvstage.pd.auth`); a wrong or
  missing one changes nothing and is counted (``bad_capability``).
- ``release(request_id)``: give the blocks back now (the engine aborted the request).
- ``serve_once()`` / ``serve_forever()``: the side channel (GetMeta, Acquire, Release,
  GetStats, and PrefillRequest when a producer is given), then NIXL notifications
  (decode's "done" frees a request) and lease expiry.

Who owns what: the engine owns the device tensors (`KVCache.wrap`), the block ids and
the forward pass; it must not reuse a request's blocks until ``on_free(request_id,
block_ids)`` is called (after decode's notification, a Release, or the lease). The
worker owns the host buffer (one registered allocation) and the injected `Transport`
(it registers the buffer now and closes the transport in `close`). With ``key`` every
side-channel message (GetMeta, hence the NIXL metadata, included) must be authenticated;
refused ones are counted (``unauthorized``). Without an engine,
``pool`` (a `BlockPool`) allocates and frees, and ``producer`` writes the KV for a
side-channel `PrefillRequest` (the CLI, demo, benches and tests use the pattern in
`kvstage.testing.pattern`).

Thread rules: everything runs on the thread that calls ``serve_once`` (NIXL agents are
not guaranteed thread-safe); ``stop`` may be called from any thread or a signal handler.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvstage.blocks import BlockPool, GroupedBlockIds
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.engine import CopyEngine, CopyStats, Direction
from kvstage.errors import InvalidRequest, KVStageError, NotHeld, Unauthorized, code_of
from kvstage.pd import auth, integrity, lease, prefill_serve
from kvstage.pd import messages as m
from kvstage.pd.prefill_state import PrefillCounters, SavedRequest
from kvstage.pd.saves import SaveQueue
from kvstage.pd.side_channel import DEFAULT_HOST, SideChannelServer
from kvstage.pd.tp_copy import HostPart, PartCopy
from kvstage.pd.tp_parts import TPSide
from kvstage.transport.base import Transport

DEFAULT_LEASE_S = 30.0
#: serve_once's longest wait while requests are held on a transport whose bytes move only
#: inside our calls (``progress_by_caller``: NIXL without its progress thread): the
#: notification poll after it progresses UCX over tcp
ACTIVE_POLL_S = 0.0005

#: Writes a prompt's KV into blocks it allocates: (request_id, num_tokens, seed) -> ids
Producer = Callable[[str, int, int], list[list[int]]]
#: Called when the worker lets go of a request's blocks: (request_id, block_ids)
OnFree = Callable[[str, list[list[int]]], None]


class PrefillWorker:
    def __init__(
        self,
        cache: KVCache,
        transport: Transport,
        *,
        host_layout: HostLayout = HostLayout.BLOCK_MAJOR,
        lease_s: float = DEFAULT_LEASE_S,
        host: str = DEFAULT_HOST,
        port: int = 0,
        engine_id: str | None = None,
        pool: BlockPool | None = None,
        producer: Producer | None = None,
        on_free: OnFree | None = None,
        key: bytes | None = None,
        insecure: bool = False,
        max_hold_s: float | None = None,
        verify_checksum: bool = False,
        tp: TPSide | None = None,
        readers: int = 1,
    ) -> None:
        if not (isinstance(lease_s, int | float) and 0 < lease_s < float("inf")):
            transport.close()
            raise InvalidRequest(f"lease_s must be a finite number > 0, got {lease_s!r}")
        max_hold = 4 * lease_s if max_hold_s is None else max_hold_s
        if isinstance(max_hold, bool) or not (isinstance(max_hold, int | float)
                                              and max_hold > 0 and math.isfinite(max_hold)):
            transport.close()
            raise InvalidRequest(f"max_hold_s must be a finite number > 0, got {max_hold_s!r}")
        self.layout = cache.layout
        self.lease_s = float(lease_s)
        self.max_hold_s = float(max_hold)
        # per-block digests at d2h, sent with the lease (`kvstage.pd.integrity`)
        self.verify_checksum = bool(verify_checksum)
        if self.verify_checksum:
            integrity.check_available()
        self.engine_id = engine_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.cache = cache
        self.pool = pool
        self.producer = producer
        self.on_free = on_free
        self.transport = transport
        # across TP sizes (`kvstage.pd.tp_copy`): the d2h cuts each page into the slices
        # the decode ranks read, and a request is freed once ``readers`` ranks read it
        self.tp = tp
        self.readers = readers
        try:
            self.host = HostBuffer.for_device(self.layout, cache.device, host_layout)
            self.engine: CopyEngine | PartCopy = (
                CopyEngine(cache, self.host) if tp is None
                else PartCopy(cache, self.host, tp.parts))
            self._slices: list[HostBuffer | HostPart] = (
                [self.host] if tp is None
                else [HostPart(self.host, tp.parts, s) for s in range(tp.parts.num_parts)])
            self._saves = SaveQueue(self.engine)
            # registered once, at start-up: pinning and key exchange are far too slow
            # per request
            self.transport.register(self.host.data_ptr, self.host.nbytes)
            # taken once: the registrations never change after start, and NIXL builds it
            # slowly on a busy core (a TP 2 prefill took 13-60 s+ per GetMeta on 2 cores)
            self.agent_metadata = self.transport.metadata()
            self.server = SideChannelServer(host, port, key=key, insecure=insecure)
        except Exception:
            self.transport.close()
            raise
        self.counters = PrefillCounters()
        self._requests: dict[str, SavedRequest] = {}
        self._stop = threading.Event()
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        return self.server.host, self.server.port

    @property
    def held_blocks(self) -> int:
        return sum(
            len([b for g in r.block_ids for b in g if b])
            for r in self._requests.values() if r.held
        )

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` has saved (or held) blocks here."""
        return request_id in self._requests

    @property
    def num_held(self) -> int:
        return sum(1 for r in self._requests.values() if r.held)

    # -- the engine's primitives ----------------------------------------------------------
    def save(self, request_id: str, block_ids: Sequence[Sequence[int]], *,
             wait: bool = True) -> CopyStats:
        """d2h ``block_ids`` (one list per group) of a request the engine is prefilling;
        ``wait=False``: queued behind the request's earlier saves, done by ``hold``."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        req = self._requests.get(request_id)
        if req is not None and req.held:
            raise InvalidRequest(
                f"request {request_id!r} is already held for decode; save every block "
                "before hold(), or use a new id"
            )
        ids = GroupedBlockIds(block_ids, self.layout)  # validates before a byte moves
        plan: Any = self.engine.plan(ids)  # CopyPlan or PartPlan, for its own engine
        if req is None:
            req = self._requests[request_id] = SavedRequest([[] for _ in block_ids])
        # per-block digests (verify_checksum) of the bytes decode will read
        flat = [b for g in ids.groups for b in g if b] if self.verify_checksum else []
        if self.readers == 0:  # a replica no decode rank reads (across TP sizes): no copy
            stats = CopyStats(Direction.D2H, 0, 0, 0, 0)
        elif wait:
            self._settle(request_id, req)  # its queued saves first: the later bytes win
            start = time.perf_counter()
            stats = self.engine.run(plan, Direction.D2H)
            self._hash(req, flat)  # after the copy (synchronised)
            req.d2h_s += time.perf_counter() - start
        else:
            stats = self.engine.stats(plan, Direction.D2H)
            self._saves.submit(request_id, plan)
            req.unhashed.update(flat)  # hashed once the copies are over (_settle)
        for have, new in zip(req.block_ids, ids.groups, strict=True):
            seen = set(have)
            have.extend(b for b in new if b not in seen)
        req.nbytes += stats.nbytes
        return stats

    @property
    def num_slices(self) -> int:
        return len(self._slices)

    def _hash(self, req: SavedRequest, block_ids: list[int]) -> None:
        """Digests of each slice's bytes of ``block_ids`` (one slice at equal TP sizes)."""
        for s, host in enumerate(self._slices):
            if block_ids:
                req.digests.update(((s, b), d) for b, d in zip(
                    block_ids, integrity.block_digests(host, block_ids), strict=True))

    def _settle(self, request_id: str, req: SavedRequest) -> None:
        """Wait for the request's queued saves; hash what they wrote."""
        if not self._saves.pending(request_id):
            return
        req.d2h_s += self._saves.wait(request_id)
        self._hash(req, sorted(req.unhashed))
        req.unhashed.clear()

    def hold(self, request_id: str, lease_s: float | None = None, *,
             capability: bytes | None = None) -> m.PrefillDone:
        """Every block is saved: hold them under a lease for decode to READ.
        ``capability``: the request's token when the engine derives it (`auth.
        derived_capability`: vLLM's scheduler hands it out, every TP rank checks the same
        one); by default a new random one."""
        req = self._requests.get(request_id)
        if req is None:
            raise NotHeld(f"request {request_id!r} has no saved blocks here; save() first")
        if req.held:
            raise InvalidRequest(f"request {request_id!r} is already held")
        self._settle(request_id, req)  # decode may READ only bytes that have landed
        now = time.monotonic()
        if capability is not None and len(capability) != auth.TOKEN_BYTES:
            raise InvalidRequest(
                f"capability must be {auth.TOKEN_BYTES} bytes, got {len(capability)}")
        req.capability = auth.new_capability() if capability is None else capability
        req.hold_until = now + self.max_hold_s
        req.deadline = lease.deadline(now, lease_s or self.lease_s, req.hold_until)
        req.held = True  # last: a held request always has its deadline and capability
        self.counters.prefilled += 1
        done = m.PrefillDone(
            request_id=request_id, block_ids=[list(g) for g in req.block_ids],
            d2h_s=req.d2h_s, nbytes=req.nbytes, lease_s=self.lease_s,
            capability=req.capability, checksums=self._checksums(req),
        )
        if self.readers == 0:  # no decode rank reads this one (a replica another serves)
            self._free(request_id)
            self.counters.completed += 1
        return done

    def _checksums(self, req: SavedRequest, slice_index: int = 0) -> list[list[int]]:
        if not self.verify_checksum:
            return []
        return [[req.digests.get((slice_index, b), 0) for b in g] for g in req.block_ids]

    def release(self, request_id: str) -> None:
        """Free a request's blocks now (held or only saved)."""
        if not self._free(request_id):
            raise NotHeld(f"request {request_id!r} is not held here")
        self.counters.released += 1

    def prefill(self, request_id: str, num_tokens: int, seed: int) -> m.PrefillDone:
        """The producer writes a prompt's KV into blocks it allocates; save and hold them."""
        if self.producer is None:
            raise InvalidRequest(
                "this prefill worker runs inside an engine: it saves what the engine "
                "writes and takes no PrefillRequest"
            )
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise InvalidRequest(
                f"request id {request_id!r} is still held (in flight); use a new id or "
                "wait until decode has read it"
            )
        block_ids = self.producer(request_id, num_tokens, seed)
        try:
            self.save(request_id, block_ids)
        except Exception:
            self._requests.pop(request_id, None)
            self._give_back(request_id, block_ids)
            raise
        return self.hold(request_id)

    # -- freeing ------------------------------------------------------------------------------
    def _give_back(self, request_id: str, block_ids: list[list[int]]) -> None:
        if self.on_free is not None:
            self.on_free(request_id, block_ids)
        elif self.pool is not None:
            for ids in block_ids:
                self.pool.free(ids)

    def _free(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        with contextlib.suppress(Exception):  # a queued copy must not read reused blocks
            self._saves.wait(request_id)
        self._give_back(request_id, req.block_ids)
        return True

    def process_notifications(self) -> None:
        for _peer, msg in self.transport.get_notifs():
            rid, token = auth.parse_notif(msg[:1024])
            req = self._requests.get(rid)
            if req is not None and req.held and auth.same_capability(token, req.capability):
                req.readers.add(_peer)  # across TP sizes several decode ranks read it
                if len(req.readers) >= self.readers:
                    self._free(rid)
                    self.counters.completed += 1
            elif req is not None and req.held:
                self.counters.bad_capability += 1  # forged: the request stays held
            else:
                # late (after lease expiry), duplicated or foreign: count, never crash
                self.counters.unknown(rid)

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        expired = [
            rid for rid, r in self._requests.items() if r.held and lease.expired(r.deadline, now)
        ]
        for rid in expired:
            self._free(rid)
            self.counters.expired += 1
        return expired

    # -- side channel ---------------------------------------------------------------------
    def _handle(self, msg: m.Message) -> m.Message:
        return prefill_serve.handle(self, msg)

    def _authorized(self, request_id: str, capability: bytes) -> SavedRequest:
        return prefill_serve.authorized(self, request_id, capability)

    def stats(self) -> m.Stats:
        return prefill_serve.stats(self)

    def serve_once(self, timeout_s: float = 0.01) -> None:
        if self._requests and self.transport.progress_by_caller:  # our calls move the bytes
            timeout_s = min(timeout_s, ACTIVE_POLL_S)
        got = self.server.poll(timeout_s)
        if got is not None:
            envelope, msg = got
            reply: m.Message
            if isinstance(msg, Exception):
                if isinstance(msg, Unauthorized):
                    self.counters.unauthorized += 1
                reply = m.Error(message=str(msg)[:512], code=code_of(msg))
            else:
                try:
                    reply = self._handle(msg)
                except (KVStageError, ValueError, TypeError) as exc:
                    # bounded: an error never echoes more than a few hundred bytes of input
                    reply = m.Error(message=str(exc)[:512], code=code_of(exc))
            self.server.reply(envelope, reply)
        self.process_notifications()
        self.expire_leases()

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a side-channel message waits (True), touching no
        state: an engine that serves from another thread waits here without its lock."""
        return self.server.readable(timeout_s)

    def serve_forever(self, *, poll_s: float = 0.005) -> None:
        """Serve until `stop` is called (from a signal handler or another thread)."""
        while not self._stop.is_set():
            self.serve_once(poll_s)

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        """Free every request, deregister memory, close the side channel and transport."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._requests):
            self._free(rid)
        self._saves.close()
        self.server.close()
        self.transport.close()

    def __enter__(self) -> PrefillWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
