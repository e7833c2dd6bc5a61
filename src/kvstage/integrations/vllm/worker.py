"""The worker side of `KVStageConnector`: one rank's pd/ roles over vLLM's KV tensors.

Contract
--------
`WorkerSide` runs in each vLLM worker process (one per tensor-parallel rank) and owns that
rank's pd/ role(s): a `kvstage.pd.prefill.PrefillWorker` (kv_producer, kv_both) and/or a
`kvstage.pd.decode.DecodeWorker` (kv_consumer, kv_both), each with its own NIXL agent and
its own block-major host buffer of this rank's shard (host bytes = the rank's device pool).

- ``register(kv_caches)``: vLLM's ``{layer: tensor}`` as pages of LOGICAL block ids (every
  group's ids index one space: `copies.page_rows`), `KVCache.wrap_layers` over them, then
  the roles. The prefill's side channel listens on ``port`` (the instance's base port plus
  this rank): at equal TP sizes decode rank r reads prefill rank r, one handshake per rank
  pair, sealed with the key when there is one. Across sizes (``peer_tp_size``, the other
  side's TP: `integrations.vllm.tp`) the prefill's pages are cut into the slices its
  readers take, and a decode rank runs one `DecodeWorker` per prefill rank it reads, each
  filling one region of the rank's pages from one shared host buffer.
- ``save(meta)`` (vLLM's ``wait_for_save``, after the forward): the step's d2h of each
  request's completed blocks (queued on the copy stream on CUDA, copied in the step on
  CPU), then the holds (every save of the request waited for, its lease started with the
  capability the scheduler hands out) and the releases.
- ``load(meta)`` (vLLM's ``start_load_kv``): one READ per request into the local ids vLLM
  allocated, h2d pipelined behind it (`kvstage.pd.pipeline`), started off the step thread
  (`loads.Loads`: a prefill that does not answer never holds a step; the handshake and
  each READ are bounded by half of ``kv_lease_duration``); ``forgets`` release
  the remote blocks a request will not read; ``fails`` end loads the scheduler refused.
- ``results(finished)`` (vLLM's ``get_transfer_results``): READs that ended (a failed one is
  in ``failed_recving`` too: vLLM's ``kv_load_failure_policy`` applies) and requests every
  prefill role let go (the decode's notification, a Release or the lease), each reported
  once vLLM has said the request finished.

Threads: vLLM's worker thread calls every method; the prefill role's side channel, its
NIXL notifications and its leases are served by one daemon thread (`_Serving`), every call
into the role under one lock (pd/'s roles are single-threaded). The thread waits on the
side channel's socket (500 ms idle, 2 ms while requests are held), so an idle instance
costs a few wake-ups a second. The decode role has its own starter thread (`loads`),
blocked on its queue when idle.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from kvstage.cache import KVCache
from kvstage.integrations.vllm import tp as tp_sides
from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.integrations.vllm.loads import Loads
from kvstage.integrations.vllm.metadata import StepMeta
from kvstage.integrations.vllm.stats import KVStageStats
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.prefill import PrefillWorker
from kvstage.pd.tp_copy import host_for
from kvstage.pd.tp_map import refuse_across_sizes

IDLE_WAIT_S = 0.5  # the serving thread's wait with nothing held (a message wakes it)
HELD_WAIT_S = 0.002  # ... while requests are held (NIXL notifications are polled)
LEASE_ENDED = "lease ended, blocks freed for request"  # logged once per request and rank
SAVE_PREFIX = "kvstage SAVE"  # the prefill's line per request with kvstage_log_reads


class _Serving(threading.Thread):
    """Serves a prefill role's side channel, notifications and leases (module doc)."""

    def __init__(self, role: PrefillWorker, lock: threading.Lock, log: Any, rank: int) -> None:
        super().__init__(name="kvstage-prefill-serve", daemon=True)
        self.role, self.lock, self.log, self.rank = role, lock, log, rank
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.role.wait(HELD_WAIT_S if self.role.num_held else IDLE_WAIT_S)
            with self.lock:
                if self.stopping.is_set():
                    return
                for rid in self.role.expire_leases():
                    self.log.warning("kvstage: rank %d: %s %s: no decode read it within its "
                                     "lease (%g s)", self.rank, LEASE_ENDED, rid,
                                     self.role.lease_s)
                self.role.serve_once(0.0)


class WorkerSide:
    """One rank's roles (module doc)."""

    def __init__(self, *, engine_id: str, rank: int, tp_size: int, producer: bool,
                 consumer: bool, key: bytes | None, host: str, port: int,
                 allow_unauthenticated: bool, verify_checksum: bool, lease_s: float,
                 progress_delay_us: int, logger: logging.Logger | Any,
                 log_reads: bool = False, peer_tp_size: int = 0) -> None:
        self.engine_id, self.rank, self.tp_size = engine_id, rank, tp_size
        # the other side's TP size (kvstage_peer_tp_size): a prefill's decodes, a decode's
        # prefills; another than ours cuts pages into the parts `kvstage.pd.tp_map` reads
        self.peer_tp_size = peer_tp_size or tp_size
        self.producer, self.consumer = producer, consumer
        self.key, self.host, self.port = key, host, port
        self.allow_unauthenticated = allow_unauthenticated
        self.verify_checksum, self.lease_s = verify_checksum, lease_s
        self.progress_delay_us = progress_delay_us
        self.log = logger
        self.lock = threading.Lock()
        self.prefill: PrefillWorker | None = None
        self.serving: _Serving | None = None
        self.held: set[str] = set()  # prefill: held here, not yet reported freed
        self.freed: set[str] = set()  # prefill: let go, to report once vLLM finished them
        self.finished: set[str] = set()  # prefill: held requests vLLM said finished
        self.released: set[str] = set()  # prefill: released on vLLM's word (not reported)
        self.refused: set[str] = set()  # loads sent to a producer-only instance
        self.loads: Loads | None = None
        self.stats = KVStageStats()
        self.log_reads = log_reads
        self.saved: dict[str, list[float]] = {}  # prefill: rid -> [blocks, seconds, ops]
        self.quiet_steps = 0  # steps with nothing to do, since the last hand-out
        self.block_bytes = 0

    # -- start ---------------------------------------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], groups: list[tuple[list[str], Any]],
                 num_blocks: int, model: str, total_kv_heads: int = 0) -> KVCache:
        """``total_kv_heads``: the model's KV heads over all ranks (vLLM's model config), to
        tell a prefill at another TP size how the pair would map (`tp_map`)."""
        cache = wrap_vllm_caches(kv_caches, groups, num_blocks, model)
        self.block_bytes = cache.layout.block_bytes
        from kvstage.transport import ucx_env
        from kvstage.transport.nixl import NixlTransport  # lazily: NIXL is optional

        # UCX as the CLI roles choose it from the address (the environment's own wins):
        # off loopback TCP on the interface that holds it, with the segment size that
        # lets a READ fill the link (`kvstage.transport.ucx_env`)
        ucx = ucx_env.choose(self.host).env
        across = self.peer_tp_size != self.tp_size
        sides: dict[str, Any] = dict(tp_size=self.tp_size, rank=self.rank,
                                     peer_tp=self.peer_tp_size,
                                     total_kv_heads=total_kv_heads, model=model)
        if self.producer:
            tp, readers = (tp_sides.prefill_side(kv_caches, groups, cache.layout, **sides)
                           if across else (None, 1))
            transport = NixlTransport(f"kvstage-p-{self.engine_id}-{self.rank}",
                                      progress_delay_us=self.progress_delay_us, ucx_env=ucx)
            self.prefill = PrefillWorker(
                cache, transport, host=self.host, port=self.port,
                engine_id=f"{self.engine_id}/{self.rank}", on_free=self._freed, key=self.key,
                insecure=self.allow_unauthenticated, verify_checksum=self.verify_checksum,
                lease_s=self.lease_s, tp=tp, readers=readers)
            if tp is not None:
                self.log.info("kvstage: rank %d: prefill TP %d for decode TP %d: pages cut "
                              "into %d slice(s), read by %d decode rank(s)", self.rank,
                              self.tp_size, self.peer_tp_size, tp.parts.num_parts, readers)
            self.serving = _Serving(self.prefill, self.lock, self.log, self.rank)
            self.serving.start()
        if self.consumer:
            roles: list[tuple[DecodeWorker, int]] = []
            if across:
                side, reads, num_slices = tp_sides.decode_side(kv_caches, groups,
                                                               cache.layout, **sides)
                whole = host_for(cache)  # one buffer, R regions
                for r in reads:
                    roles.append((self._decode_role(cache, ucx, f"{r.region_index}", tp=side,
                                                    region=r.region_index,
                                                    slice_index=r.slice_index,
                                                    num_slices=num_slices,
                                                    host_buffer=whole), r.prefill_rank))
                self.log.info("kvstage: rank %d: decode TP %d reading prefill TP %d: %s",
                              self.rank, self.tp_size, self.peer_tp_size, ", ".join(
                                  f"region {r.region_index} <- rank {r.prefill_rank} slice "
                                  f"{r.slice_index}/{num_slices}" for r in reads))
            else:
                roles.append((self._decode_role(cache, ucx, ""), self.rank))
            shards = tp_sides.group_shards(cache.layout, self.tp_size, total_kv_heads)

            def across_sizes(prefill_tp: int) -> str:
                return refuse_across_sizes(prefill_tp, self.tp_size, shards, model=model,
                                           expected=self.peer_tp_size)

            self.loads = Loads(roles, rank=self.rank, tp_size=self.tp_size,
                               prefill_tp=self.peer_tp_size, key=self.key, log=self.log,
                               log_reads=self.log_reads, across_sizes=across_sizes)
        return cache

    def _decode_role(self, cache: KVCache, ucx: dict[str, str], suffix: str,
                     **tp: Any) -> DecodeWorker:
        from kvstage.transport.nixl import NixlTransport  # lazily: NIXL is optional

        transport = NixlTransport(f"kvstage-d-{self.engine_id}-{self.rank}{suffix}",
                                  progress_delay_us=self.progress_delay_us, ucx_env=ucx)
        return DecodeWorker(
            cache, transport, engine_id=f"{self.engine_id}/{self.rank}{suffix}", key=self.key,
            verify_checksum=self.verify_checksum, pipeline=True, any_pool_size=True,
            handshake_timeout_s=self.lease_s / 2, read_timeout_s=self.lease_s / 2, **tp)

    # -- prefill -------------------------------------------------------------------------
    def _freed(self, rid: str, block_ids: list[list[int]]) -> None:
        """PrefillWorker's on_free (under the lock): report it unless vLLM released it."""
        del block_ids  # vLLM frees them once every rank reports the request
        if rid in self.released:
            self.released.discard(rid)
        elif rid in self.held:
            self.freed.add(rid)

    def save(self, meta: StepMeta) -> None:
        role = self.prefill
        if role is None or not (meta.saves or meta.holds or meta.releases):
            return
        queued = role.engine.is_cuda  # on CPU a copy thread would contend with the forward
        with self.lock:
            step: dict[str, tuple[int, float]] = {}
            for rid, ids in meta.saves.items():
                start = time.perf_counter()
                try:
                    copied = role.save(rid, ids, wait=not queued)
                except Exception:
                    self.stats.add(copy_failures=1)
                    raise
                # a replica no decode rank reads copies nothing (pd.prefill): count none
                moved = sum(len(g) for g in ids) if copied.blocks else 0
                step[rid] = (moved, time.perf_counter() - start)
                total = self.saved.setdefault(rid, [0, 0.0, 0])
                total[0] += step[rid][0]
                total[1] += step[rid][1]
                total[2] += copied.ops
            for rid, capability in meta.holds.items():
                if rid not in meta.saves and not role.has_request(rid):
                    role.save(rid, [[] for _ in role.layout.groups])  # nothing to copy
                self.held.add(rid)  # first: a rank no decode reads frees it in hold
                role.hold(rid, capability=capability)
                blocks, seconds, ops = self.saved.pop(rid, [0, 0.0, 0])
                last_blocks, last_s = step.get(rid, (0, 0.0))
                self.stats.add(d2h_blocks=int(blocks), d2h_bytes=int(blocks) * self.block_bytes,
                               d2h_seconds=seconds, d2h_last_step_blocks=last_blocks,
                               d2h_wait_seconds=last_s)
                if self.log_reads:
                    self.log.info("%s request=%s blocks=%d bytes=%d d2h_ops=%d", SAVE_PREFIX,
                                  rid, int(blocks), int(blocks) * self.block_bytes, int(ops))
            for rid in meta.releases:
                self.saved.pop(rid, None)
                self.held.discard(rid)
                self.freed.discard(rid)
                self.finished.discard(rid)
                if role.has_request(rid):
                    self.released.add(rid)
                    role.release(rid)

    # -- decode --------------------------------------------------------------------------
    def load(self, meta: StepMeta) -> None:
        loads = self.loads
        if loads is None:
            if meta.loads or meta.fails:  # a producer-only instance was sent a decode request
                rids = set(meta.loads) | set(meta.fails)
                self.log.error("kvstage: requests %s carry do_remote_prefill but this instance "
                               "is kv_producer: start it as kv_consumer or kv_both",
                               sorted(rids)[:4])
                self.refused |= rids
            return
        for rid, why in meta.fails.items():
            loads.fail(rid, why)
        for remote in meta.forgets.values():
            loads.forget(remote)
        for rid, remote in meta.heartbeats.items():
            loads.heartbeat(rid, remote)
        for rid, load in meta.loads.items():
            loads.start(rid, load)

    # -- results -------------------------------------------------------------------------
    def results(self, finished: set[str], meta: StepMeta | None = None
                ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this step; a step with
        nothing to do (``meta`` empty, nothing held, read or reported) counts as quiet."""
        loads = self.loads
        if (meta is not None and meta.empty and not (self.held or self.freed or self.refused)
                and not (loads is not None and loads.busy)):
            self.quiet_steps += 1
            return set(), set(), set()
        sending: set[str] = set()
        if self.prefill is not None and (self.held or self.freed):
            with self.lock:
                self.finished |= finished & self.held
                sending = self.freed & self.finished
                self.freed -= sending
                self.finished -= sending
                self.held -= sending
        done, failed = set(self.refused), set(self.refused)
        self.refused.clear()
        if loads is not None:
            loads.poll()
            got, lost = loads.take()
            done |= got
            failed |= lost
        return sending, done, failed

    def take_stats(self) -> KVStageStats | None:
        """The figures since the last call (then reset), or None when there are none."""
        out, self.stats = self.stats, KVStageStats()
        if self.loads is not None:
            out.aggregate(self.loads.take_stats())
        return None if out.is_empty() else out

    def close(self) -> None:
        if self.serving is not None:
            self.serving.stopping.set()
            self.serving.join(timeout=2.0)
        if self.loads is not None:
            self.loads.close()
        with self.lock:
            if self.prefill is not None:
                self.prefill.close()
