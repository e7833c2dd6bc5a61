"""`KVStageConnector`: vLLM's NIXL connector with kvstage's host buffers and copy.

Contract
--------
Loaded by vLLM (both the prefill and the decode instance must load it)::

    --kv-transfer-config '{"kv_connector": "KVStageConnector",
        "kv_connector_module_path": "kvstage.integrations.vllm",
        "kv_role": "kv_producer" | "kv_consumer", "kv_buffer_device": "cpu"}'

What it changes on vLLM's host-buffer path (``kv_buffer_device: "cpu"``), nothing else:
- Host buffers: ONE host allocation per physical device KV storage (pinned on CUDA), every
  layer name a view of it with its device view's offset, shape and strides
  (`host_buffers.mirror_host_buffers`). Layers of different KV cache groups alias on the host
  exactly as on the device, so host memory equals the device pool (vLLM: one buffer per layer
  name, about groups x the pool), and vLLM's registration, which keeps one NIXL region per
  base address and one registration per storage, registers each physical tensor once.
  With vLLM's per-layer buffers a READ fills each region for its own group's blocks only,
  then the h2d writes every layer name into the aliased device views and the last writer
  (a layer whose buffer never got those blocks) wins: wrong tokens on hybrid models.
- d2h/h2d: kvstage's `CopyEngine` (`copies.EngineCopyOp`, over ``KVCache.wrap_layers`` of
  the device tensors and ``HostBuffer.wrap_layers`` of the mirrored host ones, ids trusted:
  vLLM allocated them): one ``copy_`` per run of consecutive block ids for every physical
  tensor at once, installed instead of vLLM's per-layer-name ``copy_kv_blocks``.
- READ descriptors: one per run of blocks consecutive on both sides per region, not one
  per (region, block) (`reads.MergedReads` over vLLM's NIXL agent; vLLM's read path,
  notifications and timeouts unchanged). ``kvstage_merge_reads: false`` in
  ``kv_connector_extra_config`` keeps vLLM's per-block descriptors (benches compare);
  ``kvstage_log_reads: true`` logs every READ's counts and NIXL figures.
- Chunked prefill: the prefill side saves a request's blocks once, when its prompt is fully
  scheduled (vLLM saves each step's new blocks only, so a block a chunk boundary cut in two
  would keep its first part's bytes only).
- Handshake: the compatibility hash carries ``kvstage<N>:``; the decode side refuses a
  prefill peer whose hash lacks it, saying the peer does not run kvstage (a plain NIXL peer
  would read or serve per-layer buffers), and the check is always enforced. When vLLM's
  handshake fails, the peer's hash is asked for again (`remote_compat_hash`, bounded) to
  word the refusal: the decision is on that hash, not on vLLM's error text.
- Side channel and notifications (`secure`, `secure_handshake`): with a shared key
  (``KVSTAGE_KEY``, or a file named by ``kvstage_key_file`` in ``kv_connector_extra_config``)
  the handshake is sealed with kvstage's HMAC envelope (a peer without the key gets a
  refusal, no metadata; a decode with another key is refused, saying so), and a notification
  frees (or a heartbeat extends) a request only with its capability, which the prefill hands
  out inside ``kv_transfer_params["remote_request_id"]``. Notifications vLLM's parser would
  crash on are dropped, with or without a key. Without a key, a non-loopback
  ``VLLM_NIXL_SIDE_CHANNEL_HOST`` refuses to start unless
  ``"kvstage_allow_unauthenticated": true``; loopback works as vLLM, logged once.
- NIXL progress thread: vLLM's agent is created with a 1 ms progress-thread delay
  (``kvstage_progress_delay_us``; nixl-cu12 1.5.1's wrapper hard-codes 0, a core per
  worker busy-polling even when idle; `kvstage.transport.nixl_agent`).
- ``kv_connector_extra_config: {"kvstage_force_host_buffer": true}`` turns the host path
  on where vLLM's platform turns it off (device type "cpu": the KV already lives in DRAM),
  on the worker and the scheduler side: it is how the path is tested without a GPU.
- Checksum (`checksums`, opt-in: ``"kvstage_verify_checksum": true`` on both instances): the
  prefill digests each saved block's host bytes (xxh3-64) and hands the digests to the decode
  in ``kv_transfer_params``; the decode hashes what its READ wrote before the h2d, and a
  mismatch fails the request's KV load (vLLM's ``kv_load_failure_policy`` applies).
- Late bytes: vLLM 0.32.0 already keeps a READ's local blocks until NIXL reports it DONE or
  failed and its handle is released (an aborted request's blocks are freed only then);
  tests/system/vllm/test_vllm_late_bytes.py holds it to that, no quarantine is added.
- Stats (`stats`): vLLM's NIXL KV connector stats plus each d2h/h2d copy's blocks, bytes,
  seconds and failures (whatever is assigned to ``copy_blocks`` is metered), so the periodic
  "KV Transfer metrics" log and ``/metrics`` (``vllm:kvstage_*``) show them.

Threads: copies run where vLLM calls them (the worker's step: ``wait_for_save``,
``get_finished``); this module starts no thread (vLLM's listener thread runs
`secure_handshake.serve_handshake`, vLLM's handshake thread the sealed query).

vLLM versions supported: 0.32.0 and 0.33.0 (sleep mode refused: ``supports_sleep_mode``
False, ``unregister_kv_caches``/``restore_kv_caches`` raise). The subclass surface, all of
it, is recorded per version in tests/integrations/test_vllm_surface.py (`surface.SURFACE`;
scripts/vllm_surface.py reads it from a wheel; everything else is vLLM's own code):
- `KVStageConnector(NixlConnector)`: ``__init__`` (calls ``NixlBaseConnector.__init__`` and
  builds the two classes below instead of NixlConnector's), the classmethods
  ``build_kv_connector_stats``, ``build_prom_metrics`` and ``supports_sleep_mode``,
  ``unregister_kv_caches`` and ``restore_kv_caches`` (0.33.0), ``build_connector_worker_meta``.
- `KVStageConnectorWorker(NixlConnectorWorker)`: ``__init__``, ``initialize_host_xfer_buffer``,
  ``set_host_xfer_buffer_ops``, ``register_kv_caches``, ``_nixl_handshake``,
  ``save_kv_to_host``, ``start_load_kv``, ``_pop_done_transfers`` (checksums); attributes
  used: ``use_host_buffer``, ``host_xfer_buffers``, ``copy_blocks``, ``compat_hash``,
  ``enforce_compat_hash``, ``xfer_handshake_metadata``, ``kv_transfer_config``,
  ``xfer_stats`` (replaced by a `stats.KVStageStats`; ``copy_blocks`` becomes a property),
  ``nixl_wrapper`` (its ``get_new_notifs`` wrapped on the instance, `secure`; its
  ``get_xfer_descs``, ``prep_xfer_dlist``, ``release_dlist_handle``, ``make_prepped_xfer``,
  ``get_xfer_telemetry`` wrapped on the instance, `reads`: vLLM's read path must keep
  posting ``make_prepped_xfer("READ", local_handle, local_ids, remote_handle, remote_ids,
  notif_msg=...)`` over lists it prepared from ``[N, 3]`` arrays), ``engine_id``.
  vLLM's ``_nixl_handshake`` runs unchanged inside a thread-local switch that seals the REQ
  socket it opens with the module global ``nixl.base_worker.zmq_ctx`` (wrapped once per
  process; it calls ``setsockopt``, ``send``, ``recv_multipart`` on it).
- `stats`: ``NixlKVConnectorStats`` (``reset``, ``is_empty``, ``aggregate``, ``reduce``,
  ``data``), ``NixlPromMetrics`` (``__init__``, ``observe``), ``create_metric_per_engine``.
- `KVStageConnectorScheduler(NixlConnectorScheduler)`: ``__init__``, ``_build_save_meta``,
  ``_nixl_handshake_listener`` (a staticmethod in vLLM, replaced by a method; vLLM's thread
  calls it with its arguments), ``request_finished`` (its ``remote_request_id`` gains the
  capability), ``build_connector_meta``, ``update_connector_output`` (checksums);
  attributes used: ``use_host_buffer``, ``_reqs_need_save``, ``_reqs_need_recv``,
  ``get_exchange_clipped_blocks``, ``side_channel_host``, ``engine_id``.
- Other vLLM names used: ``NixlHandshakePayload``, ``GET_META_MSG``, the handshake wire
  (query ``(GET_META_MSG, pp_rank, tp_rank)``, reply ``[payload, perf_counter]``), the
  notification texts ``<id>:<consumers>`` and ``HB:<id>,...`` (``_get_new_notifs``),
  ``envs.VLLM_NIXL_SIDE_CHANNEL_HOST``, ``make_zmq_path``, ``get_from_extra_config``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1.base import CopyBlocksOp, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
    NixlConnector,
    NixlConnectorScheduler,
    NixlConnectorWorker,
    NixlHandshakePayload,
)
from vllm.distributed.nixl_utils import NixlWrapper
from vllm.logger import init_logger

from kvstage.integrations.vllm import checksums, secure, secure_handshake
from kvstage.integrations.vllm.copies import EngineCopyOp, kvstage_groups
from kvstage.integrations.vllm.host_buffers import host_nbytes, mirror_host_buffers
from kvstage.integrations.vllm.reads import install_merged_reads
from kvstage.integrations.vllm.stats import (
    KVStagePromMetrics,
    KVStageStats,
    metered_copy_blocks,
)
from kvstage.transport.nixl_agent import (
    DEFAULT_PROGRESS_DELAY_US,
    check_progress_delay,
    progress_delay,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# under "vllm." so the messages go where vLLM's own go
logger = init_logger(f"vllm.{__name__}")

#: Bumped whenever the bytes kvstage puts on the wire change meaning.
KVSTAGE_PROTOCOL = 1
HASH_PREFIX = f"kvstage{KVSTAGE_PROTOCOL}:"
FORCE_HOST_BUFFER_KEY = "kvstage_force_host_buffer"
PROGRESS_DELAY_KEY = "kvstage_progress_delay_us"
SLEEP_MODE_REFUSAL = (
    "KVStageConnector does not support vLLM's sleep mode (--enable-sleep-mode; vLLM 0.33.0 "
    "asks connectors through supports_sleep_mode): releasing and restoring kvstage's host "
    "buffers, their NIXL registration and its copy op across a sleep is not implemented, "
    "as it cannot be tested without a GPU (vLLM's sleep needs its CUDA memory pool). Start "
    "the instance without --enable-sleep-mode"
)

def _force_host_buffer(vllm_config: VllmConfig) -> bool:
    cfg = vllm_config.kv_transfer_config
    assert cfg is not None
    if cfg.kv_buffer_device != "cpu":
        raise ValueError(
            f"KVStageConnector stages KV through host memory: kv_buffer_device must be "
            f'\'cpu\', got {cfg.kv_buffer_device!r}; add "kv_buffer_device": "cpu" to '
            "--kv-transfer-config (or use NixlConnector for device-to-device transfers)"
        )
    return bool(cfg.get_from_extra_config(FORCE_HOST_BUFFER_KEY, False))


def _sleeping_progress_thread(vllm_config: VllmConfig) -> contextlib.AbstractContextManager[None]:
    """`kvstage.transport.nixl_agent.progress_delay` around the NIXL wrapper vLLM uses
    (``kvstage_progress_delay_us`` in ``kv_connector_extra_config``, default 1000; 0
    keeps NIXL's busy loop). A NIXL without that wrapper shape is left as it is."""
    cfg = vllm_config.kv_transfer_config
    assert cfg is not None
    delay = cfg.get_from_extra_config(PROGRESS_DELAY_KEY, DEFAULT_PROGRESS_DELAY_US)
    check_progress_delay(delay)
    api = sys.modules.get(getattr(NixlWrapper, "__module__", ""), None)
    if api is None or not hasattr(api, "nixlBind"):
        return contextlib.nullcontext()
    return progress_delay(api, delay)


class KVStageConnectorWorker(NixlConnectorWorker):
    """NIXL worker whose host buffers alias like the device and whose copy is fused."""

    compat_hash: str | None  # set by vLLM's register_kv_caches
    xfer_handshake_metadata: Any
    # every copy op assigned (vLLM's None, kvstage's) is timed into the KV stats (stats.py)
    copy_blocks = metered_copy_blocks()

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        # vLLM creates its NIXL agent in here: give its progress thread a delay, as
        # kvstage's own agents have (nixl-cu12 1.5.1's wrapper busy-polls a core each)
        self._kvstage_security = secure.Security.from_config(vllm_config)  # before any agent
        with _sleeping_progress_thread(vllm_config):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        # notifications must carry the request's capability (secure.py); handshakes sealed
        secure.guard_notifications(
            self.nixl_wrapper, secure.NotificationGuard(self._kvstage_security.key, engine_id)
        )
        secure_handshake.install()
        # READs post one descriptor per run per region, not per (region, block): reads.py
        self._kvstage_reads = install_merged_reads(
            self.nixl_wrapper, self.kv_transfer_config.kv_connector_extra_config or {}, logger
        )
        self.xfer_stats = KVStageStats()  # vLLM's NIXL figures plus kvstage's copies
        if _force_host_buffer(vllm_config):
            self.use_host_buffer = True
        if self.kv_transfer_config.enable_permute_local_kv:
            raise ValueError(
                "KVStageConnector keeps the host layout equal to the device layout; "
                "enable_permute_local_kv (heterogeneous TP permute) is not supported"
            )
        # Both sides must stage through kvstage's buffers: the check is not optional.
        self.enforce_compat_hash = True
        self._copier: EngineCopyOp | None = None
        extra = self.kv_transfer_config.kv_connector_extra_config
        self._kvstage_checksums = checksums.WorkerChecksums(
            checksums.enabled(extra, vllm_config.parallel_config.world_size)
        )

    def initialize_host_xfer_buffer(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.host_xfer_buffers = mirror_host_buffers(kv_caches)
        groups = [(g.layer_names, g.kv_cache_spec) for g in self.kv_cache_config.kv_cache_groups]
        self._copier = EngineCopyOp(
            kv_caches, self.host_xfer_buffers, kvstage_groups(groups, kv_caches)
        )
        # vLLM's model runner installs its copy op later on GPU platforms, never on CPU:
        # set ours now, so the path is complete whatever the platform.
        self.copy_blocks = self._copier
        self._kvstage_checksums.attach(
            self._copier.engine.host.tensor_views, self._physical_blocks_per_logical_kv_block
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
            len({(t.data_ptr(), t.shape) for t in kv_caches.values()}),
        )

    # opt-in checksum (checksums.py): digest after the save, verify before the h2d
    def save_kv_to_host(self, metadata: NixlConnectorMetadata) -> None:
        super().save_kv_to_host(metadata)
        self._kvstage_checksums.after_save(metadata)

    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        self._kvstage_checksums.expect(metadata)
        super().start_load_kv(metadata)

    def _pop_done_transfers(self, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        if transfers is self._recving_transfers:  # a mismatch fails the load (no h2d)
            failed |= self._kvstage_checksums.verify(done - failed, self._recving_metadata)
        return done, failed

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
        try:
            with secure_handshake.sealed_handshakes(security.key):
                return super()._nixl_handshake(host, port, *args, **kwargs)
        except secure_handshake.HandshakeRefused:
            raise  # says why already (a refusal or a reply that failed the key check)
        except RuntimeError as e:
            # Decided on the peer's hash, asked for again, never on vLLM's error text.
            remote = remote_compat_hash(host, port, key=security.key)
            if remote is None or remote == self.compat_hash:
                raise  # not a hash mismatch (or the peer is gone): vLLM's error stands
            if remote.startswith(secure_handshake.REFUSED_PREFIX):  # e.g. we have no key
                raise secure_handshake.HandshakeRefused(
                    f"the prefill at {host}:{port} refused the handshake: "
                    f"{remote[len(secure_handshake.REFUSED_PREFIX):]!r}"
                ) from e
            if not remote.startswith("kvstage"):
                raise RuntimeError(
                    f"refused the prefill peer at {host}:{port}: it does not run kvstage's "
                    f"KV connector (its handshake hash {remote[:16]}... has no "
                    f"{HASH_PREFIX!r} prefix). Both instances must load KVStageConnector "
                    '("kv_connector": "KVStageConnector", "kv_connector_module_path": '
                    '"kvstage.integrations.vllm"): a plain NixlConnector peer stages '
                    "through per-layer buffers that do not match kvstage's host layout"
                ) from e
            raise RuntimeError(
                f"the prefill peer at {host}:{port} runs kvstage but a different "
                f"configuration or version (local hash {self.compat_hash}, remote "
                f"{remote}): {e}"
            ) from e


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


class KVStageConnectorScheduler(NixlConnectorScheduler):
    """NIXL scheduler side: host path switchable on CPU, save once per finished prompt."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._kvstage_security = secure.Security.from_config(
            vllm_config, side_channel_host=self.side_channel_host
        )
        if _force_host_buffer(vllm_config):
            self.use_host_buffer = True
        # request id -> the block ids scheduled so far, per KV cache group
        self._kvstage_pending: dict[str, list[list[int]]] = {}
        self._kvstage_checksums = checksums.SchedulerChecksums(
            checksums.enabled(vllm_config.kv_transfer_config.kv_connector_extra_config,
                              vllm_config.parallel_config.world_size)
        )

    def _nixl_handshake_listener(
        self,
        encoded_data: dict[tuple[int, int], bytes],
        ready_event: threading.Event,
        stop_event: threading.Event,
        host: str,
        port: int,
    ) -> None:
        # vLLM's thread runs kvstage's listener: sealed with the key, refusing the rest
        secure_handshake.serve_handshake(
            encoded_data, ready_event, stop_event, host, port, key=self._kvstage_security.key
        )

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        key = self._kvstage_security.key
        if key is not None and params is not None and "remote_request_id" in params:
            # the reader's notifications for this request must carry its capability
            params["remote_request_id"] = secure.with_capability(
                key, self.engine_id, request.request_id
            )
        self._kvstage_checksums.finished(request.request_id, params)
        return delay_free, params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        collected = self._kvstage_checksums.collect(self._reqs_need_recv, self._reqs_need_save)
        meta = super().build_connector_meta(scheduler_output)
        checksums.SchedulerChecksums.attach(meta, collected)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self._kvstage_checksums.update(connector_output.kv_connector_worker_meta)

    def _build_save_meta(
        self, meta: NixlConnectorMetadata, scheduler_output: SchedulerOutput
    ) -> None:
        # Forget requests vLLM dropped from the save set (aborted partial prefills).
        for req_id in list(self._kvstage_pending):
            if req_id not in self._reqs_need_save:
                del self._kvstage_pending[req_id]
        num_scheduled = scheduler_output.num_scheduled_tokens
        assert num_scheduled is not None
        for req_id, new_block_ids, resumed in yield_req_data(scheduler_output):
            req = self._reqs_need_save.get(req_id)
            if req is None:
                continue
            groups = self._kvstage_pending.get(req_id)
            if new_block_ids is not None:
                if groups is None or resumed:  # a resumed request lists all its blocks
                    groups = [list(g) for g in new_block_ids]
                else:
                    for acc, new in zip(groups, new_block_ids, strict=True):
                        acc.extend(new)
                self._kvstage_pending[req_id] = groups
            if req.num_computed_tokens + num_scheduled[req_id] < req.num_prompt_tokens:
                continue  # partial prefill: save when the last chunk has run
            del self._reqs_need_save[req_id]
            self._kvstage_pending.pop(req_id, None)
            if not groups:
                continue
            assert req.kv_transfer_params is not None
            meta.add_new_req_to_save(
                request_id=req_id,
                local_block_ids=self.get_exchange_clipped_blocks(tuple(groups), clip_ssm=False),
                kv_transfer_params=req.kv_transfer_params,
            )


class KVStageConnector(NixlConnector):
    """vLLM's NIXL (pull) connector with kvstage's host-buffer side; see the module doc."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        # NixlConnector.__init__ would build vLLM's own worker (a NIXL agent and a side
        # channel) only for it to be replaced: start from the base class instead.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        assert self.engine_id is not None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVStageConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVStageConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )
        else:
            raise ValueError(f"unsupported KV connector role: {role!r}")

    def build_connector_worker_meta(self) -> checksums.ChecksumMeta | None:
        worker = self.connector_worker
        return None if worker is None else worker._kvstage_checksums.worker_meta()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStageStats:
        return KVStageStats(data=data) if data is not None else KVStageStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStagePromMetrics:
        return KVStagePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # vLLM 0.33.0: sleep mode is refused (README "vLLM versions"); vLLM raises on False
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        logger.error(SLEEP_MODE_REFUSAL)
        return False

    def unregister_kv_caches(self) -> None:
        raise RuntimeError(SLEEP_MODE_REFUSAL)

    def restore_kv_caches(self) -> None:
        raise RuntimeError(SLEEP_MODE_REFUSAL)
