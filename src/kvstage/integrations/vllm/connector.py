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
- ``kvstage_log_reads: true`` logs every READ's NIXL figures (`stats.log_reads`).
- State hybrids (Mamba1/2, gated delta net, short conv, linear attention: vLLM's
  ``MambaSpec`` groups beside attention, `state`): every layer is addressed as pages of
  vLLM's LOGICAL block ids (state layers arrive as int8 views strided by the padded page,
  attention possibly in kernel blocks), the d2h/h2d copy those ids (``save_kv_to_host`` and
  ``sync_recved_kv_to_device`` replaced: vLLM flattens kernel and state ids, two index
  spaces), a state slot is saved after the prompt's last chunk (below). Any other spec,
  and a Mamba model without ``VLLM_SSM_CONV_STATE_LAYOUT=DS``, is refused at start in one
  line naming it and the fix.
- Chunked prefill (`prompt_saves`, `chunk_saves`): each step saves the attention blocks it
  COMPLETED that the transfer keeps, queued on a background copy (a CUDA copy stream, or a
  CPU thread) while later chunks compute; the prompt's last step saves the rest (the
  blocks its chunk touched, state slots) and waits for all of them before the request's
  params leave. vLLM saves each step's new blocks, so a block a chunk boundary cut in two
  would keep its first part's bytes only. ``kvstage_save_by_chunk: false``: the whole
  prompt in its last step.
- Handshake: the compatibility hash carries ``kvstage<N>:``; the decode side refuses a
  prefill peer whose hash lacks it, saying the peer does not run kvstage (a plain NIXL peer
  would read or serve per-layer buffers), and the check is always enforced. The decode asks
  a new peer's hash (`remote_compat_hash`, bounded) before vLLM's handshake and refuses a
  foreign one at once; when vLLM's handshake fails, it asks again to word the refusal: the
  decision is on that hash, never on vLLM's error text.
- Side channel and notifications (`secure`, `secure_handshake`): with a shared key
  (``KVSTAGE_KEY``, or a file named by ``kvstage_key_file`` in ``kv_connector_extra_config``)
  the handshake is sealed with kvstage's HMAC envelope (a peer without the key gets a
  refusal, no metadata; a decode with another key is refused, saying so), and a notification
  frees (or a heartbeat extends) a request only with its capability, which the prefill hands
  out inside ``kv_transfer_params["remote_request_id"]``. Notifications vLLM's parser would
  crash on are dropped, with or without a key. Without a key, a non-loopback
  ``VLLM_NIXL_SIDE_CHANNEL_HOST`` refuses to start unless
  ``"kvstage_allow_unauthenticated": true``; loopback works as vLLM, logged once.
- CPU placement: on a CPU platform vLLM's NIXL worker pins the worker thread to the
  machine's last core of each NUMA node, over ``taskset`` and ``VLLM_CPU_OMP_THREADS_BIND``;
  when that core is off the instance's CPUs the worker puts the thread back (else every
  instance's forward shares one core: BENCHMARKS "vLLM's NIXL worker moved the prefill's
  worker"); a move within them is vLLM's choice and is kept.
- NIXL progress thread: vLLM's agent is created with a progress-thread delay
  (``kvstage_progress_delay_us``, default 20 ms; nixl-cu12 1.5.1's wrapper hard-codes 0, a
  core per worker busy-polling even when idle; `kvstage.transport.nixl_agent`).
- ``kv_connector_extra_config: {"kvstage_force_host_buffer": true}`` turns the host path
  on where vLLM's platform turns it off (device type "cpu": the KV already lives in DRAM),
  on the worker and the scheduler side: it is how the path is tested without a GPU.
- Checksum (`checksums`, opt-in: ``"kvstage_verify_checksum": true`` on both instances): the
  prefill digests each saved block's host bytes (xxh3-64) and hands the digests to the decode
  in ``kv_transfer_params["kvstage"]``; the decode hashes what its READ wrote before the h2d, and a
  mismatch fails the request's KV load (vLLM's ``kv_load_failure_policy`` applies).
- Lease check (`lease`, always on): the prefill hands out the end of its lease on a
  request's blocks in ``kv_transfer_params["kvstage"]`` (``lease_expires``, its
  ``perf_counter``); the decode does not start a READ whose lease ends within
  ``kvstage_lease_margin_s`` (default ``kv_lease_duration // 6 + 2`` s) on its clock, as
  vLLM's handshake offset maps it, and fails that request's KV load instead (vLLM's
  ``kv_load_failure_policy`` applies): freed blocks may hold another request's KV.
- Late bytes: vLLM 0.32.0 already keeps a READ's local blocks until NIXL reports it DONE or
  failed and its handle is released (an aborted request's blocks are freed only then);
  tests/system/vllm/test_vllm_late_bytes.py holds it to that, no quarantine is added.
- Stats (`stats`): vLLM's NIXL KV connector stats plus each d2h/h2d copy's blocks, bytes,
  seconds and failures (kvstage's copy op is metered where kvstage installs it), joined
  when vLLM asks for the step's stats, so the periodic "KV Transfer metrics" log and
  ``/metrics`` (``vllm:kvstage_*``) show them.
- Hook times (`hook_time`, ``kvstage_time_hooks: true``): every per-step hook vLLM calls
  here is timed (wall ns), the totals reach ``/metrics`` about once a second
  (``vllm:kvstage_hook_seconds_total{hook}``, ``..._calls_total``): the connector's own cost
  per engine step, on a running instance. Off by default, nothing is wrapped.
- Quiet steps (`quiet`): a worker step whose metadata carries nothing for the connector,
  with no READ or send of its own in flight, skips vLLM's NIXL bookkeeping
  (``start_load_kv``, ``get_transfer_results``, the save, the load-error queue, vLLM's
  stats); a scheduler build with no transfer-touching hook since the last one is an empty
  metadata. A full pass still runs every ``kvstage_quiet_poll_ms`` (default 100; 0: every
  step, as vLLM); ``vllm:kvstage_quiet_steps_total{side}`` counts the quiet ones.
- Settings: `config.KVStageConfig`, parsed once per connector (README "Connector settings");
  per-request fields: `request_params` (README "What travels per request").

Threads: copies run where vLLM calls them (the worker's step: ``wait_for_save``,
``get_finished``), a prefill's earlier chunks' d2h on `chunk_saves`' copy thread or
stream; this module starts no thread (vLLM's listener thread runs
`secure_handshake.serve_handshake`, vLLM's handshake thread the sealed query).

vLLM versions supported: 0.32.0 and 0.33.0 (sleep mode refused: ``supports_sleep_mode``
False, ``unregister_kv_caches``/``restore_kv_caches`` raise). Every vLLM name the connector
package uses is listed in `surface.SURFACE` and recorded per version in
tests/integrations/test_vllm_surface.py (scripts/vllm_surface.py reads it from a wheel);
README "The vLLM surface" lists each private name and runtime replacement with why, and
tests/integrations/test_vllm_behaviour.py holds vLLM to the behaviour relied on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlBaseConnector, NixlConnector
from vllm.logger import init_logger

from kvstage.integrations.vllm import checksums
from kvstage.integrations.vllm.config import KVStageConfig
from kvstage.integrations.vllm.hook_time import HOOK_KEY, HookClock, time_hooks
from kvstage.integrations.vllm.quiet import QUIET_KEY, take
from kvstage.integrations.vllm.scheduler import KVStageConnectorScheduler
from kvstage.integrations.vllm.settings import HASH_PREFIX, KVSTAGE_PROTOCOL
from kvstage.integrations.vllm.stats import (
    KVStagePromMetrics,
    KVStageStats,
    log_reads,
    with_copies,
)
from kvstage.integrations.vllm.worker import KVStageConnectorWorker, remote_compat_hash
from kvstage.pd.integrity import check_available

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = [
    "HASH_PREFIX",
    "KVSTAGE_PROTOCOL",
    "SLEEP_MODE_REFUSAL",
    "KVStageConnector",
    "KVStageConnectorScheduler",
    "KVStageConnectorWorker",
    "remote_compat_hash",
]

# under "vllm." so the messages go where vLLM's own go
logger = init_logger(f"vllm.{__name__}")

SLEEP_MODE_REFUSAL = (
    "KVStageConnector does not support vLLM's sleep mode (--enable-sleep-mode; vLLM 0.33.0 "
    "asks connectors through supports_sleep_mode): releasing and restoring kvstage's host "
    "buffers, their NIXL registration and its copy op across a sleep is not implemented, "
    "as it cannot be tested without a GPU (vLLM's sleep needs its CUDA memory pool). Start "
    "the instance without --enable-sleep-mode"
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
        self.kvstage_config = KVStageConfig.from_vllm(vllm_config)  # once: refuses bad values
        if self.kvstage_config.verify_checksum:
            check_available()  # the install hint now, not at the first request
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        # the once-a-second tick of the stats; with kvstage_time_hooks, the hooks' times
        # (vllm:kvstage_hook_seconds_total: the connector's own cost per step)
        self.kvstage_clock = HookClock(side)
        if self.kvstage_config.time_hooks:
            time_hooks(self, self.kvstage_clock)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVStageConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config, self.kvstage_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = KVStageConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config, self.kvstage_config
            )
        else:
            raise ValueError(f"unsupported KV connector role: {role!r}")

    def build_connector_worker_meta(self) -> checksums.ChecksumMeta | None:
        worker = self.connector_worker
        return None if worker is None else worker._kvstage_checksums.worker_meta()

    def get_kv_connector_stats(self) -> KVStageStats | None:
        # about once a second (hook_time.py), on both sides: the steps quiet since the last
        # time (quiet.py) and, when timed, the hooks' times
        clock = self.kvstage_clock
        worker, scheduler = self.connector_worker, self.connector_scheduler
        timed: dict[str, list[list[Any]]] = {}
        if clock.due():
            quiet = take(worker.kvstage_quiet if worker is not None
                         else scheduler.kvstage_quiet)
            hooks = clock.take()
            if quiet:
                timed[QUIET_KEY] = [[clock.side, quiet]]
            if hooks:
                timed[HOOK_KEY] = hooks
        if worker is None or not worker.kvstage_quiet.stats_due():
            # the scheduler side, or a worker whose steps since the last call were quiet
            # (quiet.py: no bookkeeping, no copy ran; a copy thread's late figures wait
            # for the next full step)
            if not timed:
                return None
            stats = KVStageStats()  # vLLM's keys too: its is_empty reads them
            stats.data.update(timed)
            return stats
        nixl = worker.get_kv_connector_stats()  # vLLM's figures of the step (and a reset)
        if self.kvstage_config.log_reads:
            log_reads(nixl, logger)
        for key, entries in timed.items():
            worker.kvstage_copies.data[key].extend(entries)
        return with_copies(nixl, worker.kvstage_copies)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        worker = self.connector_worker
        if worker is not None and not worker.kvstage_quiet.step_is_full():
            return KVConnectorTransferResults()  # a quiet step: nothing can have finished
        results = super().get_transfer_results(finished_req_ids)
        if worker is not None:  # checksum mismatches: finished, and failed (no h2d ran)
            results.failed_recving |= worker.take_failed(results.finished_recving)
            worker.kvstage_quiet.reported(results.finished_sending, results.finished_recving,
                                          results.failed_recving)
        return results

    # quiet steps (quiet.py): no save was planned, no load can have failed
    def wait_for_save(self) -> None:
        worker = self.connector_worker
        if worker is None or worker.kvstage_quiet.step_is_full():
            super().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker
        if worker is not None and not worker.kvstage_quiet.step_is_full():
            return set()
        return super().get_block_ids_with_load_errors()

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
