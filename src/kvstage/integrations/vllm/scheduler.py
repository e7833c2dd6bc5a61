"""`KVStageConnectorScheduler`: vLLM's NIXL scheduler side with kvstage's per-chunk saves,
capabilities in the returned ``kv_transfer_params``, the sealed handshake listener and the
per-request fields (`request_params`) handed to the decode and to the worker.

Contract and subclass surface: see `kvstage.integrations.vllm.connector`'s module doc and
README "The vLLM surface". Only public connector hooks are overridden here, apart from the
handshake listener: requests are tracked from ``update_state_after_alloc`` (not vLLM's
private maps), and kvstage's save plan (`prompt_saves`: each chunk's completed blocks,
the rest at the prompt's end) replaces the save entries of the metadata vLLM built
(``build_connector_meta``). Threads: vLLM's listener thread runs
`secure_handshake.serve_handshake`.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlConnectorMetadata,
    NixlConnectorScheduler,
)
from vllm.logger import init_logger

from kvstage.integrations.vllm import checksums, lease, request_params, secure, secure_handshake
from kvstage.integrations.vllm.config import KVStageConfig
from kvstage.integrations.vllm.copies import saved_by_chunk
from kvstage.integrations.vllm.quiet import QuietBuilds
from kvstage.integrations.vllm.request_params import RequestParams
from kvstage.pd.prompt_saves import PromptSaves

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")


class KVStageConnectorMetadata(NixlConnectorMetadata):
    """vLLM's NIXL metadata of one step plus kvstage's per-request fields, one typed field
    (``requests``) instead of attributes set on vLLM's object. The views the worker pieces
    read (``kvstage_leases``, ``kvstage_lease_extensions``, ``kvstage_checksums``) derive
    from it. The prefill's saves: ``reqs_to_save`` holds what each request copies this
    step; ``saves_final`` the requests whose prompt completed (the blocks the decode will
    READ), ``saves_dropped`` those that ended before (`prompt_saves`, `chunk_saves`)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: dict[str, RequestParams] = {}
        self.saves_final: dict[str, list[list[int]]] = {}
        self.saves_dropped: set[str] = set()

    @classmethod
    def of(cls, meta: NixlConnectorMetadata, requests: dict[str, RequestParams],
           saves_final: dict[str, list[list[int]]] | None = None,
           saves_dropped: set[str] | None = None) -> KVStageConnectorMetadata:
        """``meta`` (vLLM's, as its scheduler built it) with kvstage's fields."""
        out = cls()
        out.__dict__.update(meta.__dict__)
        out.requests = requests
        out.saves_final = saves_final or {}
        out.saves_dropped = saves_dropped or set()
        return out

    @property
    def kvstage_leases(self) -> dict[str, float]:
        return {r: p.lease_expires for r, p in self.requests.items()
                if p.lease_expires is not None}

    @property
    def kvstage_lease_extensions(self) -> dict[str, float]:
        return {r: p.lease_extension_s for r, p in self.requests.items()
                if p.lease_extension_s is not None}

    @property
    def kvstage_checksums(self) -> dict[str, Any]:
        return {r: RequestParams(checksums=p.checksums).encode().get("checksums")
                for r, p in self.requests.items()}


class QuietMetadata(KVStageConnectorMetadata):
    """The metadata of a quiet step (`quiet`): empty, and pickled as its class alone. vLLM
    pickles every step's metadata to the worker: an empty `KVStageConnectorMetadata` is
    325 bytes and about 10 us to pickle and unpickle (BENCHMARKS "Quiet steps")."""

    kvstage_quiet = True  # `quiet.carries_work` answers without reading the fields

    def __reduce__(self) -> tuple[type[QuietMetadata], tuple[()]]:
        return (QuietMetadata, ())


class KVStageConnectorScheduler(NixlConnectorScheduler):
    """NIXL scheduler side: host path switchable on CPU, saves planned per chunk."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig,
        config: KVStageConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._kvstage = config or KVStageConfig.from_vllm(vllm_config)
        self._kvstage_security = secure.Security.from_config(
            self._kvstage, side_channel_host=self.side_channel_host
        )
        if self._kvstage.force_host_buffer:
            self.use_host_buffer = True
        # prefill: request id -> the request, while its prompt is being saved
        self._kvstage_saving: dict[str, Request] = {}
        self._kvstage_saves = PromptSaves(
            _save_groups(kv_cache_config), lambda ids: self.get_exchange_clipped_blocks(
                ids, clip_ssm=False), by_chunk=self._kvstage.save_by_chunk)
        self._kvstage_dropped: set[str] = set()  # ended before their last save
        # decode: request id -> its kvstage fields, for the step's metadata
        self._kvstage_recv: dict[str, RequestParams] = {}
        self._kvstage_checksums = checksums.SchedulerChecksums(self._kvstage.verify_checksum)
        # prefill: params handed out this step whose digests come with the step's output
        self._kvstage_unpacked: list[dict[str, Any]] = []
        #: steps with no transfer build an empty metadata, not vLLM's (quiet.py)
        self.kvstage_quiet = QuietBuilds(self._kvstage.quiet_poll_ms / 1000)

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

    def on_new_request(self, request: Request) -> None:
        super().on_new_request(request)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            self.kvstage_quiet.wait(request.request_id)  # vLLM heartbeats while it waits

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if params:
            self.kvstage_quiet.touch()
        if self.use_host_buffer and params.get("do_remote_decode"):
            self._kvstage_saving[rid] = request  # (re)scheduled: blocks follow
            self._kvstage_saves.add(rid)
            # vLLM's per-chunk saves are replaced (`_plan_saves`): its scheduler does not
            # track the request for saving at all (it would keep a request whose last chunk
            # brought no new block, as vLLM 0.32.0 does: nothing removes it then)
            self.use_host_buffer = False
            try:
                super().update_state_after_alloc(request, blocks, num_external_tokens)
            finally:
                self.use_host_buffer = True
            return
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            self._kvstage_recv[rid] = self._decode_params(rid, params)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    @staticmethod
    def _decode_params(rid: str, params: dict[str, Any]) -> RequestParams:
        try:
            return request_params.decode(params.get(request_params.KEY))
        except ValueError as e:
            logger.error("kvstage: request %s: %s; its KV load fails", rid, e)
            return RequestParams(lease_expires=math.nan)  # the lease check refuses it

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        started = time.perf_counter()  # before vLLM stamps its deadline: never later
        if request.kv_transfer_params:
            self.kvstage_quiet.touch()
        self.kvstage_quiet.done((request.request_id,))
        self._kvstage_saving.pop(request.request_id, None)  # saved, or aborted
        if self._kvstage_saves.drop(request.request_id):  # aborted with saves queued
            self._kvstage_dropped.add(request.request_id)
        delay_free, params = super().request_finished(request, block_ids)
        lease.stamp(params, delay_free, started, self._kvstage.lease_duration_s)
        key = self._kvstage_security.key
        if key is not None and params is not None and "remote_request_id" in params:
            # the reader's notifications for this request must carry its capability
            params["remote_request_id"] = secure.with_capability(
                key, self.engine_id, request.request_id
            )
        self._kvstage_checksums.finished(request.request_id, params)
        request_params.pack(params)
        if (self._kvstage.verify_checksum and params is not None
                and params.get("do_remote_prefill")):
            self._kvstage_unpacked.append(params)  # digests may be filled in this step
        return delay_free, params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStageConnectorMetadata:
        if not self.kvstage_quiet.full(
                busy=bool(self._kvstage_saving or self._kvstage_recv or self._kvstage_dropped)):
            return QuietMetadata()  # a quiet step: nothing for the worker
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, NixlConnectorMetadata)
        final = self._plan_saves(meta, scheduler_output) if self.use_host_buffer else {}
        recv, self._kvstage_recv = self._kvstage_recv, {}
        dropped, self._kvstage_dropped = self._kvstage_dropped, set()
        return KVStageConnectorMetadata.of(meta, recv, final, dropped)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        self.kvstage_quiet.done(connector_output.finished_recving or ())
        self._kvstage_checksums.update(connector_output.kv_connector_worker_meta)
        for params in self._kvstage_unpacked:  # SchedulerChecksums filled them in place
            request_params.pack(params)
        self._kvstage_unpacked.clear()

    def _plan_saves(self, meta: NixlConnectorMetadata,
                    scheduler_output: SchedulerOutput) -> dict[str, list[list[int]]]:
        """This step's save entries, from kvstage's plan (`prompt_saves`) instead of vLLM's
        (its scheduler tracks none: see ``update_state_after_alloc``): a partial prefill's
        newly completed blocks, then at the prompt's last step the blocks not yet saved
        (clipped as vLLM clips a transfer). Returns the requests whose prompt completed,
        with the blocks the decode will READ."""
        final: dict[str, list[list[int]]] = {}
        if not self._kvstage_saving:
            return final  # no prompt being saved (most steps): no walk over the batch
        num_scheduled = scheduler_output.num_scheduled_tokens
        assert num_scheduled is not None
        for req_id, new_block_ids, resumed in yield_req_data(scheduler_output):
            req = self._kvstage_saving.get(req_id)
            if req is None:
                continue
            save = self._kvstage_saves.step(
                req_id, new_block_ids, resumed,
                req.num_computed_tokens + num_scheduled[req_id], req.num_prompt_tokens)
            if req_id not in self._kvstage_saves:
                del self._kvstage_saving[req_id]  # its prompt completed
            if save is None:
                continue
            if save.final is not None:
                final[req_id] = [list(g) for g in save.final]
            if any(save.ids):
                assert req.kv_transfer_params is not None
                meta.add_new_req_to_save(request_id=req_id, local_block_ids=save.ids,
                                         kv_transfer_params=req.kv_transfer_params)
        return final


def _save_groups(config: KVCacheConfig) -> list[int | None]:
    """`PromptSaves`' block sizes: tokens per block of each group saved chunk by chunk
    (`copies.saved_by_chunk`: full and sliding-window attention), None for the rest (state
    groups: saved at the prompt's end). All None when vLLM transfers only some groups."""
    groups = config.kv_cache_groups
    if len(config.transfer_group_ids) != len(groups):
        return [None] * len(groups)
    return [g.kv_cache_spec.block_size if saved_by_chunk(g.kv_cache_spec) else None
            for g in groups]
