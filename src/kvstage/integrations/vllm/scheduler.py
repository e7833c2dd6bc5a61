"""`KVStageConnectorScheduler`: vLLM's NIXL scheduler side with kvstage's save-once-per-prompt,
capabilities in the returned ``kv_transfer_params``, the sealed handshake listener and the
checksum hand-over.

Contract and subclass surface: see `kvstage.integrations.vllm.connector`'s module doc.
Threads: vLLM's listener thread runs `secure_handshake.serve_handshake`.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorScheduler

from kvstage.integrations.vllm import checksums, lease, secure, secure_handshake
from kvstage.integrations.vllm.settings import force_host_buffer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVStageConnectorScheduler(NixlConnectorScheduler):
    """NIXL scheduler side: host path switchable on CPU, save once per finished prompt."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._kvstage_security = secure.Security.from_config(
            vllm_config, side_channel_host=self.side_channel_host
        )
        if force_host_buffer(vllm_config):
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
        started = time.perf_counter()  # before vLLM stamps its deadline: never later
        delay_free, params = super().request_finished(request, block_ids)
        lease.stamp(params, delay_free, started, self._kv_lease_duration)
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
        leases = lease.collect(self._reqs_need_recv)
        meta = super().build_connector_meta(scheduler_output)
        meta.kvstage_leases = leases
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
