"""`KVStageConnectorWorker`: vLLM's NIXL worker with kvstage's host buffers, copy engine,
sealed handshake, notification guard, lease check, checksums and copy stats.

Contract and subclass surface: see `kvstage.integrations.vllm.connector`'s module doc and
README "The vLLM surface". Threads: copies run where vLLM calls them (the worker's step);
vLLM's handshake thread runs the sealed query (`secure_handshake.SealedHandshake`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import CopyBlocksOp
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnectorWorker,
    NixlHandshakePayload,
)
from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

from kvstage.integrations.vllm import checksums, lease, secure, secure_handshake
from kvstage.integrations.vllm.chunk_saves import WorkerSaves
from kvstage.integrations.vllm.config import KVStageConfig
from kvstage.integrations.vllm.copies import EngineCopyOp, kvstage_groups
from kvstage.integrations.vllm.host_buffers import host_nbytes, mirror_host_buffers
from kvstage.integrations.vllm.quiet import QuietSteps
from kvstage.integrations.vllm.settings import HASH_PREFIX, sleeping_progress_thread
from kvstage.integrations.vllm.state import copy_logical, refuse_unservable
from kvstage.integrations.vllm.stats import KVStageStats, MeteredCopy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.v1.kv_cache_interface import KVCacheConfig

# under "vllm." so the messages go where vLLM's own go
logger = init_logger(f"vllm.{__name__}")


class _Finished:
    """``r in _Finished(done)``: True unless ``r`` is in ``done`` (for `WorkerLeases.prune`)."""

    def __init__(self, done: set[str]) -> None:
        self.done = done

    def __contains__(self, rid: object) -> bool:
        return rid not in self.done


class KVStageConnectorWorker(NixlConnectorWorker):
    """NIXL worker whose host buffers alias like the device and whose copy is fused."""

    compat_hash: str | None  # set by vLLM's register_kv_caches
    xfer_handshake_metadata: Any

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig,
        config: KVStageConfig | None = None,
    ) -> None:
        self._kvstage = config or KVStageConfig.from_vllm(vllm_config)  # refuses bad values
        refuse_unservable(vllm_config, kv_cache_config)  # one line, before vLLM's asserts
        self._kvstage_security = secure.Security.from_config(self._kvstage)  # before any agent
        # vLLM creates its NIXL agent in here: give its progress thread a delay, as
        # kvstage's own agents have (nixl-cu12 1.5.1's wrapper busy-polls a core each).
        # On a CPU platform it also pins this thread (the one that runs the forward) to
        # the machine's last core of each NUMA node. Within the instance's own CPUs that is
        # vLLM's choice (a core for the transfer); outside them (a 1P1D pair on 2 cores:
        # the prefill's worker on the decode's core) the thread is put back.
        placement = os.sched_getaffinity(0)
        try:
            with sleeping_progress_thread(self._kvstage.progress_delay_us):
                super().__init__(vllm_config, engine_id, kv_cache_config)
        finally:
            keep_within(placement)
        # notifications must carry the request's capability (secure.py); handshakes sealed
        secure.guard_notifications(
            self.nixl_wrapper, secure.NotificationGuard(self._kvstage_security.key, engine_id)
        )
        # with a key, vLLM's handshake code on kvstage's sealed socket (checked at start)
        self._kvstage_handshake = secure_handshake.SealedHandshake.for_key(
            self._kvstage_security.key
        )
        if self._kvstage.force_host_buffer:
            self.use_host_buffer = True
        # Both sides must stage through kvstage's buffers: the check is not optional.
        self.enforce_compat_hash = True
        self._copier: EngineCopyOp | None = None
        self._kvstage_saves: WorkerSaves | None = None  # prefill's d2h (chunk_saves.py)
        #: kvstage's copies since vLLM last asked for stats (`stats.with_copies`)
        self.kvstage_copies = KVStageStats()
        self._kvstage_checksums = checksums.WorkerChecksums(self._kvstage.verify_checksum)
        self._kvstage_leases = lease.WorkerLeases(self._kvstage.lease_margin_s)
        #: decode: requests whose READ bytes failed the checksum (reported as failed loads)
        self.kvstage_failed: set[str] = set()
        #: steps with no transfer skip vLLM's bookkeeping (quiet.py; connector.py asks it)
        self.kvstage_quiet = QuietSteps(self._kvstage.quiet_poll_ms / 1000)

    def initialize_host_xfer_buffer(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.host_xfer_buffers = mirror_host_buffers(kv_caches)
        config = self.kv_cache_config
        groups = [(g.layer_names, g.kv_cache_spec) for g in config.kv_cache_groups]
        model = str(self.vllm_config.model_config.model)
        # rows of LOGICAL blocks (vLLM's block pool ids): state groups' ids and attention
        # groups' (kernel blocks: a tensor of num_blocks x r rows) index one space (state.py)
        self._copier = EngineCopyOp(
            kv_caches, self.host_xfer_buffers,
            kvstage_groups(groups, kv_caches, config.num_blocks, model), config.num_blocks,
        )
        # vLLM's model runner installs its copy op later on GPU platforms, never on CPU:
        # set ours now (metered: stats.py), so the path is complete whatever the platform.
        self.copy_blocks = MeteredCopy(self._copier, self.kvstage_copies)
        self._kvstage_saves = WorkerSaves(self._copier, self.kvstage_copies)
        kernel_blocks = max(t.shape[0] // config.num_blocks for t in kv_caches.values())
        self._kvstage_checksums.attach(
            self._copier.engine.host.tensor_views, kernel_blocks,
            checksums.read_extents(self._copier.layout),
        )
        per_layer = sum(t.nbytes for t in kv_caches.values())
        logger.info(
            "kvstage host buffers: %d layer names over %d allocation(s), %d bytes "
            "(per-layer-name buffers would take %d); %d physical tensors, one copy per run "
            "for all of them",
            len(kv_caches),
            len({t.untyped_storage().data_ptr() for t in self.host_xfer_buffers.values()}),
            host_nbytes(self.host_xfer_buffers),
            per_layer,
            self._copier.layout.num_tensors,  # state and attention views alias one tensor
        )

    # d2h and h2d of LOGICAL block ids, the scheduler's (``local_block_ids``: vLLM's worker
    # would expand attention groups to kernel ids and flatten them with state groups'
    # logical ids, two index spaces once a block is split; state.py); the d2h chunk by
    # chunk (copied in the step on CPU, queued on CUDA), a prompt's complete at its last
    # step (chunk_saves.py); the opt-in checksum (checksums.py) digests then and verifies
    # before the h2d
    def save_kv_to_host(self, metadata: NixlConnectorMetadata) -> None:
        final = getattr(metadata, "saves_final", {})
        dropped = getattr(metadata, "saves_dropped", ())
        if not (metadata.reqs_to_save or final or dropped):
            return  # vLLM calls this every step; most steps save nothing
        assert self._kvstage_saves is not None
        with gpu_sync_allowed():  # a prompt's last step waits for its saves, as vLLM's
            self._kvstage_saves.save(
                {rid: [b for g in m.local_block_ids for b in g]
                 for rid, m in metadata.reqs_to_save.items()}, final, dropped)
        self._kvstage_checksums.after_save(final)

    def sync_recved_kv_to_device(self, req_id: str, meta: Any) -> None:
        if self._kvstage_checksums.verify([req_id], {req_id: meta}):
            self.kvstage_failed.add(req_id)  # no h2d: the load fails (connector.py)
            return
        with gpu_sync_allowed():
            copy_logical(self, "h2d", [[b for g in meta.local_block_ids for b in g]])

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        if not self.kvstage_quiet.begin(metadata):
            return  # a quiet step: nothing to start, vLLM's bookkeeping skipped (quiet.py)
        self._kvstage_checksums.expect(metadata)
        self._kvstage_leases.expect(metadata)
        super().start_load_kv(metadata)
        # vLLM sent this step's heartbeats (to handshaken prefills) as its last act
        self._kvstage_leases.heartbeats_sent(metadata, self._engine_clock_offset)

    def take_failed(self, finished_recving: set[str]) -> set[str]:
        """The checksum failures to report as failed loads; forgets what finished."""
        self._kvstage_leases.prune(_Finished(finished_recving))
        failed, self.kvstage_failed = self.kvstage_failed, set()
        return failed

    # lease.py: no READ of blocks whose prefill lease may have ended (fails the load)
    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        why = self._kvstage_leases.refusal(req_id, meta, self._engine_clock_offset)
        if why is None:
            if self._kvstage_saves is not None:  # no late save over what the READ writes
                self._kvstage_saves.drain()
            super()._read_blocks_for_req(req_id, meta)
            return
        lease.WorkerLeases.log(req_id, meta.remote.engine_id, why)
        self.xfer_stats.record_kv_expired_req()
        # as vLLM declines an expired turn-2 read: the request ends in failed_recving
        self._handle_failed_transfer(
            req_id, None, self._recv_failures, record_failed_transfer=False
        )

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        # vLLM's op copies every layer name (aliases again); ours is already in place.
        del copy_operation

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        assert self.compat_hash is not None
        payload = self.xfer_handshake_metadata
        self.compat_hash = HASH_PREFIX + self.compat_hash
        self.xfer_handshake_metadata = NixlHandshakePayload(
            compatibility_hash=self.compat_hash,
            agent_metadata_bytes=payload.agent_metadata_bytes,
        )

    def _nixl_handshake(
        self, host: str, port: int, *args: Any, **kwargs: Any
    ) -> tuple[dict[tuple[int, int], str], float]:
        security = self._kvstage_security
        security.check_address(host, action="handshake with the prefill at")
        # The peer's hash first (one round trip per new peer, bounded): a peer that is not
        # kvstage is refused on it, whatever vLLM's handshake would then raise (a listener
        # too slow for its 5 s gives zmq.Again, not its hash mismatch). No answer: vLLM's
        # handshake decides, and its failure asks once more below.
        remote = remote_compat_hash(host, port, key=security.key)
        if remote is not None:
            refuse_foreign(host, port, remote)
        try:
            if self._kvstage_handshake is None:
                return super()._nixl_handshake(host, port, *args, **kwargs)
            return self._kvstage_handshake(self, host, port, *args, **kwargs)
        except secure_handshake.HandshakeRefused:
            raise  # says why already (a refusal or a reply that failed the key check)
        except RuntimeError as e:
            # Decided on the peer's hash, asked for again, never on vLLM's error text.
            remote = remote_compat_hash(host, port, key=security.key)
            if remote is None or remote == self.compat_hash:
                raise  # not a hash mismatch (or the peer is gone): vLLM's error stands
            refuse_foreign(host, port, remote, cause=e)
            raise RuntimeError(
                f"the prefill peer at {host}:{port} runs kvstage but a different "
                f"configuration or version (local hash {self.compat_hash}, remote "
                f"{remote}): {e}"
            ) from e


def refuse_foreign(host: str, port: int, remote: str, cause: Exception | None = None) -> None:
    """Raise, saying why, when the peer at ``host:port`` whose handshake hash is ``remote``
    refused us or does not run kvstage's connector; return when it runs kvstage."""
    if remote.startswith(secure_handshake.REFUSED_PREFIX):  # e.g. we have no key
        raise secure_handshake.HandshakeRefused(
            f"the prefill at {host}:{port} refused the handshake: "
            f"{remote[len(secure_handshake.REFUSED_PREFIX):]!r}"
        ) from cause
    if not remote.startswith("kvstage"):
        raise RuntimeError(
            f"refused the prefill peer at {host}:{port}: it does not run kvstage's "
            f"KV connector (its handshake hash {remote[:16]}... has no "
            f"{HASH_PREFIX!r} prefix). Both instances must load KVStageConnector "
            '("kv_connector": "KVStageConnector", "kv_connector_module_path": '
            '"kvstage.integrations.vllm"): a plain NixlConnector peer stages '
            "through per-layer buffers that do not match kvstage's host layout"
        ) from cause


def keep_within(placement: set[int]) -> None:
    """Put this thread back on ``placement`` if it was moved off the instance's CPUs (its
    parent's, the engine core's: ``taskset``'s), logged; a move within them is kept."""
    moved = os.sched_getaffinity(0)
    try:
        instance = os.sched_getaffinity(os.getppid())
    except OSError:
        instance = placement
    if moved <= instance:
        return
    logger.info("kvstage: this worker thread's CPUs %s restored (vLLM's NIXL worker had "
                "moved it to %s, off the instance's %s)", sorted(placement), sorted(moved),
                sorted(instance))
    os.sched_setaffinity(0, placement)


def remote_compat_hash(
    host: str, port: int, *, key: bytes | None = None, timeout_s: float = 5.0
) -> str | None:
    """The compatibility hash a vLLM NIXL handshake listener at ``host:port`` sends (its
    rank 0's payload, as vLLM's own handshake asks for it; sealed with ``key``), or None if
    it does not answer in ``timeout_s`` or answers with something else."""
    try:
        payload = secure_handshake.fetch_payload(host, port, key, timeout_s=timeout_s)
    except secure_handshake.HandshakeRefused:
        return None
    return None if payload is None else str(payload.compatibility_hash)
