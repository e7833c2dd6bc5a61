"""PrefillWorker: KV d2h into a registered host buffer, served to decode over NIXL.

Lifecycle of a request: `prefill` allocates its blocks, writes its KV (the verifiable
pattern stands in for the forward pass), copies d2h with the fused engine and holds
the blocks. Decode confirms the lease over the side channel (`Acquire`), READs, and the
READ's notification frees the blocks; if no notification arrives, the lease (default
30 s) frees them. Everything runs on one thread (NIXL agents are not guaranteed
thread-safe): `serve_once` handles one side-channel message, then notifications and
leases.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from kvstage.blocks import BlockPool, GroupedBlockIds, request_blocks
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.engine import CopyEngine
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd.handshake import DEFAULT_HOST, SideChannelServer
from kvstage.testing.pattern import fill_request
from kvstage.transport.factory import make_transport

DEFAULT_LEASE_S = 30.0


@dataclass
class _Held:
    block_ids: list[list[int]]
    deadline: float


@dataclass
class PrefillCounters:
    prefilled: int = 0
    completed: int = 0  # freed by a decode notification
    released: int = 0  # freed by an explicit Release
    expired: int = 0  # freed by the lease
    unknown_notifs: list[str] = field(default_factory=list)


class PrefillWorker:
    def __init__(
        self,
        layout: KVLayout,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        device: str = "cpu",
        host_layout: HostLayout = HostLayout.BLOCK_MAJOR,
        lease_s: float = DEFAULT_LEASE_S,
        transport: str = "nixl",
        engine_id: str | None = None,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.layout = layout
        self.lease_s = lease_s
        self.engine_id = engine_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.cache = KVCache(layout, device)
        self.host = HostBuffer.for_device(layout, device, host_layout)
        self.engine = CopyEngine(self.cache, self.host)
        self.pool = BlockPool(layout.num_blocks)
        self.counters = PrefillCounters()
        self._held: dict[str, _Held] = {}
        self.transport = make_transport(transport, self.engine_id)
        try:
            # registered once, at start-up: pinning and key exchange are far too slow
            # per request
            self.transport.register(self.host.data_ptr, self.host.nbytes)
            self.server = SideChannelServer(host, port)
        except Exception:
            self.transport.close()
            raise
        self._stop = threading.Event()
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        return self.server.host, self.server.port

    @property
    def held_blocks(self) -> int:
        return sum(len([b for g in h.block_ids for b in g if b]) for h in self._held.values())

    # -- request lifecycle ------------------------------------------------------------
    def prefill(self, request_id: str, num_tokens: int, seed: int) -> m.PrefillDone:
        """Allocate, write and d2h one prompt's KV; hold its blocks under a lease."""
        if not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self._held:
            raise ValueError(
                f"request id {request_id!r} is still held (in flight); use a new id or "
                "wait until decode has read it"
            )
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        counts = request_blocks(self.layout, num_tokens)
        if sum(counts) > self.pool.num_free:
            raise ValueError(
                f"a {num_tokens}-token prompt needs {sum(counts)} blocks, only "
                f"{self.pool.num_free} are free; start the worker with more blocks"
            )
        block_ids = [self.pool.allocate(n) for n in counts]
        fill_request(self.cache, block_ids, seed)
        start = time.perf_counter()
        stats = self.engine.save_to_host(GroupedBlockIds(block_ids, self.layout))
        d2h_s = time.perf_counter() - start
        self._held[request_id] = _Held(block_ids, time.monotonic() + self.lease_s)
        self.counters.prefilled += 1
        return m.PrefillDone(
            request_id=request_id,
            block_ids=block_ids,
            d2h_s=d2h_s,
            nbytes=stats.nbytes,
            lease_s=self.lease_s,
        )

    def _free(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        for ids in held.block_ids:
            self.pool.free(ids)
        return True

    def process_notifications(self) -> None:
        for _peer, msg in self.transport.get_notifs():
            rid = msg.decode(errors="replace")
            if self._free(rid):
                self.counters.completed += 1
            else:
                # late (after lease expiry), duplicated or foreign: report, never crash
                self.counters.unknown_notifs.append(rid)

    def expire_leases(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        expired = [rid for rid, h in self._held.items() if h.deadline <= now]
        for rid in expired:
            self._free(rid)
            self.counters.expired += 1
        return expired

    # -- side channel -------------------------------------------------------------------
    def _handle(self, msg: m.Message) -> m.Message:
        if isinstance(msg, m.GetMeta):
            return m.Meta(
                engine_id=self.engine_id,
                agent_name=self.transport.name,
                agent_metadata=self.transport.metadata(),
                layout=m.layout_to_msg(self.layout),
                host_layout=self.host.host_layout.value,
                host_base=self.host.data_ptr,
                host_nbytes=self.host.nbytes,
                lease_s=self.lease_s,
            )
        if isinstance(msg, m.PrefillRequest):
            return self.prefill(msg.request_id, msg.num_tokens, msg.seed)
        if isinstance(msg, m.Acquire):
            held = self._held.get(msg.request_id)
            if held is None:
                return m.Error(
                    message=f"request {msg.request_id!r} is not held here (never prefilled, "
                    "already read, released, or its lease expired)"
                )
            # like vLLM's heartbeats: a decode about to READ extends the lease
            held.deadline = time.monotonic() + self.lease_s
            return m.Lease(request_id=msg.request_id, remaining_s=self.lease_s)
        if isinstance(msg, m.Release):
            if self._free(msg.request_id):
                self.counters.released += 1
                return m.Ok()
            return m.Error(message=f"request {msg.request_id!r} is not held here")
        if isinstance(msg, m.GetStats):
            return self.stats()
        return m.Error(message=f"prefill worker does not handle {type(msg).__name__}")

    def stats(self) -> m.Stats:
        c = self.counters
        return m.Stats(
            held_requests=len(self._held),
            held_blocks=self.held_blocks,
            free_blocks=self.pool.num_free,
            prefilled=c.prefilled,
            completed=c.completed,
            released=c.released,
            expired=c.expired,
            unknown_notifs=list(c.unknown_notifs),
            open_handles=self.transport.num_open_handles,
        )

    def serve_once(self, timeout_s: float = 0.01) -> None:
        got = self.server.poll(timeout_s)
        if got is not None:
            envelope, msg = got
            if isinstance(msg, ValueError):
                reply: m.Message = m.Error(message=str(msg))
            else:
                try:
                    reply = self._handle(msg)
                except ValueError as exc:
                    reply = m.Error(message=str(exc))
            self.server.reply(envelope, reply)
        self.process_notifications()
        self.expire_leases()

    def serve_forever(self, *, poll_s: float = 0.005) -> None:
        """Serve until `stop` is called (from a signal handler or another thread)."""
        while not self._stop.is_set():
            self.serve_once(poll_s)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Free every held request, deregister memory, close the side channel."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._held):
            self._free(rid)
        self.server.close()
        self.transport.close()

    def __enter__(self) -> PrefillWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
