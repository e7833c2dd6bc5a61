"""`KVStageConnector` on vLLM's public connector API, with kvstage's pd/ roles as its engine.

Contract
--------
Loaded by vLLM on both instances of a P/D pair::

    --kv-transfer-config '{"kv_connector": "KVStageConnector",
        "kv_connector_module_path": "kvstage.integrations.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_buffer_device": "cpu"}'

It derives from ``KVConnectorBase_V1`` and ``SupportsHMA`` only: no vLLM connector is
subclassed, no vLLM function is copied or replaced at run time. The scheduler side
(`scheduler.SchedulerSide`) speaks vLLM's P/D proxy protocol (``kv_transfer_params``:
``do_remote_decode`` on the prefill, ``remote_block_ids``, ``remote_host`` and
``remote_port`` on the decode), so vllm-router, vLLM's proxy and ``vllm bench serve`` work
unchanged. The worker side (`worker.WorkerSide`) runs one rank's pd/ roles: each rank its
own NIXL agent, host buffer and side channel (``VLLM_NIXL_SIDE_CHANNEL_PORT`` + DP rank x
TP + TP rank, on ``VLLM_NIXL_SIDE_CHANNEL_HOST``); decode rank r reads prefill rank r
(equal TP sizes; another size fails the load, saying so).

Settings: `kvstage.integrations.vllm.config.KVStageConfig` (``kv_connector_extra_config``);
the ones this connector reads: ``kvstage_key_file`` (or ``KVSTAGE_KEY``),
``kvstage_allow_unauthenticated``, ``kvstage_verify_checksum`` (per rank, any TP),
``kvstage_progress_delay_us``, ``kvstage_save_by_chunk``, ``kv_lease_duration``.

Refused at start, one line each: a layer kind kvstage cannot copy, a Mamba model without
``VLLM_SSM_CONV_STATE_LAYOUT=DS``, pipeline parallelism, a group vLLM keeps out of
transfers, a non-loopback side channel without a key (unless opted in), sleep mode.

Threads: vLLM's threads call the hooks; the prefill role's one serving thread
(`worker._Serving`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.logger import init_logger

from kvstage.integrations.vllm.config import KVStageConfig
from kvstage.integrations.vllm.hook_time import HOOK_KEY, HookClock, time_hooks
from kvstage.integrations.vllm.metadata import StepMeta
from kvstage.integrations.vllm.scheduler import SchedulerSide
from kvstage.integrations.vllm.secure import Security
from kvstage.integrations.vllm.state import refuse_unservable
from kvstage.integrations.vllm.stats import QUIET_KEY, KVStagePromMetrics, KVStageStats
from kvstage.integrations.vllm.worker import WorkerSide
from kvstage.pd.integrity import check_available

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")

SLEEP_MODE_REFUSAL = (
    "KVStageConnector does not support vLLM's sleep mode (--enable-sleep-mode): releasing "
    "and restoring kvstage's host buffers and their NIXL registration across a sleep is not "
    "implemented. Start the instance without --enable-sleep-mode"
)


def side_channel_address(env: Mapping[str, str]) -> tuple[str, int]:
    """The instance's side channel: the variables and defaults vLLM's NIXL connector uses
    (``VLLM_NIXL_SIDE_CHANNEL_HOST``, default localhost; ``VLLM_NIXL_SIDE_CHANNEL_PORT``,
    default 5600), so a deployment moves between the two connectors unchanged."""
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or "localhost"
    text = env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or "5600"
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise ValueError(f"KVStageConnector: VLLM_NIXL_SIDE_CHANNEL_PORT={text!r}: expected a "
                         "port 1..65535 (rank r of the instance listens on it + r)")
    return host, port


def _refuse_setup(vllm_config: Any, kv_cache_config: Any) -> None:
    refuse_unservable(vllm_config, kv_cache_config)
    pp = int(vllm_config.parallel_config.pipeline_parallel_size)
    if pp != 1:
        raise ValueError(f"KVStageConnector: pipeline_parallel_size={pp}: expected 1 "
                         "(tensor parallelism is supported, pipeline parallelism is not)")
    groups = kv_cache_config.kv_cache_groups
    kept = [g for g in groups if getattr(g, "enable_kv_transfer", True)]
    if len(kept) != len(groups):
        raise ValueError(f"KVStageConnector: vLLM keeps {len(groups) - len(kept)} of "
                         f"{len(groups)} KV cache groups out of transfers; kvstage moves "
                         "every group: serve this model with vLLM's own connector")


class KVStageConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's connector interface onto kvstage's pd/ roles (module doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.step_meta: StepMeta | None = None  # the step's, between bind and clear
        self.kvstage_config = config = KVStageConfig.from_vllm(vllm_config)
        _refuse_setup(vllm_config, kv_cache_config)
        if config.verify_checksum:
            check_available()  # the install hint now, not at the first request
        kv = vllm_config.kv_transfer_config
        assert kv is not None and kv.engine_id is not None
        host, port = side_channel_address(os.environ)
        security = Security.from_config(config, side_channel_host=host)
        parallel = vllm_config.parallel_config
        tp = int(parallel.tensor_parallel_size)
        base_port = port + int(parallel.data_parallel_rank) * tp
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(
                vllm_config, kv_cache_config, engine_id=kv.engine_id, key=security.key,
                host=host, port=base_port, save_by_chunk=config.save_by_chunk,
                lease_s=config.lease_duration_s)
        elif role == KVConnectorRole.WORKER:
            rank = get_tensor_model_parallel_rank()
            self.worker_side = WorkerSide(
                engine_id=kv.engine_id, rank=rank,
                tp_size=get_tensor_model_parallel_world_size(),
                producer=bool(kv.is_kv_producer), consumer=bool(kv.is_kv_consumer),
                key=security.key, host=host, port=base_port + rank,
                allow_unauthenticated=config.allow_unauthenticated,
                verify_checksum=config.verify_checksum, lease_s=config.lease_duration_s,
                progress_delay_us=config.progress_delay_us, logger=logger,
                log_reads=config.log_reads, peer_tp_size=config.peer_tp_size)
        else:
            raise ValueError(f"unsupported KV connector role: {role!r}")
        # the once-a-second tick of the stats; with kvstage_time_hooks, the hooks' times
        self.clock = HookClock("worker" if self.worker_side is not None else "scheduler")
        if config.time_hooks:
            time_hooks(self, self.clock)

    # -- stats ---------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This side's figures since the last call (`stats`): the copies and READs when
        there are any, the hook times and quiet steps about once a second."""
        side = self.worker_side or self.scheduler_side
        assert side is not None
        stats = self.worker_side.take_stats() if self.worker_side is not None else None
        if self.clock.due():
            hooks, quiet = self.clock.take(), side.quiet_steps
            side.quiet_steps = 0
            if hooks or quiet:
                stats = stats or KVStageStats()
                if hooks:
                    stats.data[HOOK_KEY] = hooks
                if quiet:
                    stats.data[QUIET_KEY] = [[self.clock.side, quiet]]
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStageStats:
        return KVStageStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVStagePromMetrics:
        return KVStagePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side -------------------------------------------------------------------------
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker hook called on the scheduler side"
        return self.worker_side

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, StepMeta), type(connector_metadata)
        self.step_meta = connector_metadata

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.step_meta = None

    def _meta(self) -> StepMeta:
        assert self.step_meta is not None, "a step hook called outside a step"
        return self.step_meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        config = self.kv_cache_config
        groups = [(list(g.layer_names), g.kv_cache_spec) for g in config.kv_cache_groups]
        model = str(self.vllm_config.model_config.model)
        heads = int(self.vllm_config.model_config.get_total_num_kv_heads())
        cache = self._worker().register(kv_caches, groups, int(config.num_blocks), model,
                                        total_kv_heads=heads)
        logger.info("kvstage: rank %d: %d layer names over %d physical tensors, host buffer "
                    "%d bytes (block-major), side channel %s:%d", self._worker().rank,
                    len(kv_caches), cache.layout.num_tensors, cache.layout.pool_bytes,
                    self._worker().host, self._worker().port)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the READ and its h2d complete before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved per step, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._worker().save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker().results(finished_req_ids, self._meta())
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()

    # -- scheduler side ----------------------------------------------------------------------
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler hook called on a worker"
        return self.scheduler_side

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMeta:
        return self._scheduler().build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (list(block_ids),))

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    # -- sleep mode: refused -----------------------------------------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        logger.error(SLEEP_MODE_REFUSAL)
        return False

    def unregister_kv_caches(self) -> None:
        raise RuntimeError(SLEEP_MODE_REFUSAL)

    def restore_kv_caches(self) -> None:
        raise RuntimeError(SLEEP_MODE_REFUSAL)


__all__ = ["KVStageConnector"]
