"""A KV connector that does nothing: what vLLM's own connector machinery costs a step.

With any KV connector, vLLM wraps every attention layer's call (``maybe_transfer_kv_layer``),
collects a ``KVConnectorOutput`` every step and runs its scheduler-side connector calls;
this one answers each call with nothing (no tokens matched, empty metadata, no threads,
no memory), so a server running it pays that machinery and nothing else. `bench.step_cost`
serves it beside a plain server and a kvstage one (``--arrangements null``) to tell vLLM's
share of a connector's per-step cost from kvstage's. Bench tooling only: the server finds
it as ``"kv_connector_module_path": "bench.null_connector"`` (the repository on its path).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

__all__ = ["NullConnector"]


class NullConnector(KVConnectorBase_V1):
    # worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
