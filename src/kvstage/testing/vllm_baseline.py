"""vLLM's own NIXL host-buffer path, switched on where vLLM's CPU platform turns it off.

For comparisons only (tests, benches), never for serving. Loaded by vLLM like any external
connector: ``"kv_connector": "VLLMHostPathConnector", "kv_connector_module_path":
"kvstage.testing.vllm_baseline", "kv_buffer_device": "cpu"``.

Everything is vLLM 0.32.0's NixlConnector (per-layer-name host buffers from
``initialize_host_xfer_buffer``, vLLM's ``copy_kv_blocks``, per-group regions) except the
three things the CPU platform lacks for this path: ``use_host_buffer`` forced on (worker and
scheduler), the copy op installed (vLLM's model runner skips it on CPU), and the platform's
``insert_blocks_to_device`` / ``swap_out_blocks_to_host``, given the CUDA platform's bodies
(``dst[dst_idx] = src[src_idx].to(dst.device)``) where the platform has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
from vllm.platforms import current_platform

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def insert_blocks_to_device(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    dst[dst_idx] = src[src_idx].to(dst.device)


def swap_out_blocks_to_host(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    dst[dst_idx] = src[src_idx].cpu()


def install_platform_copy_bodies() -> None:
    """Give the current platform vLLM's CUDA bodies where it has none (the CPU platform)."""
    platform_cls = type(current_platform)
    for name, body in (
        ("insert_blocks_to_device", insert_blocks_to_device),
        ("swap_out_blocks_to_host", swap_out_blocks_to_host),
    ):
        if not hasattr(platform_cls, name):
            setattr(platform_cls, name, staticmethod(body))


class VLLMHostPathConnector(NixlConnector):
    """vLLM's NixlConnector with its host-buffer path forced on."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            self.connector_scheduler.use_host_buffer = True
        if self.connector_worker is not None:
            install_platform_copy_bodies()
            self.connector_worker.use_host_buffer = True
            self.connector_worker.copy_blocks = copy_kv_blocks
