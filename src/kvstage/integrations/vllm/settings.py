"""Settings both sides of `KVStageConnector` read, and the wire's protocol tag.

Contract: `force_host_buffer` validates ``kv_buffer_device`` and reads
``kvstage_force_host_buffer``; `sleeping_progress_thread` wraps the construction of vLLM's
NIXL agent in kvstage's progress-thread delay. Imports vLLM (loaded only with the connector).
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

from vllm.distributed.nixl_utils import NixlWrapper

from kvstage.transport.nixl_agent import (
    DEFAULT_PROGRESS_DELAY_US,
    check_progress_delay,
    progress_delay,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Bumped whenever the bytes kvstage puts on the wire change meaning.
KVSTAGE_PROTOCOL = 1
HASH_PREFIX = f"kvstage{KVSTAGE_PROTOCOL}:"
FORCE_HOST_BUFFER_KEY = "kvstage_force_host_buffer"
PROGRESS_DELAY_KEY = "kvstage_progress_delay_us"


def force_host_buffer(vllm_config: VllmConfig) -> bool:
    cfg = vllm_config.kv_transfer_config
    assert cfg is not None
    if cfg.kv_buffer_device != "cpu":
        raise ValueError(
            f"KVStageConnector stages KV through host memory: kv_buffer_device must be "
            f'\'cpu\', got {cfg.kv_buffer_device!r}; add "kv_buffer_device": "cpu" to '
            "--kv-transfer-config (or use NixlConnector for device-to-device transfers)"
        )
    return bool(cfg.get_from_extra_config(FORCE_HOST_BUFFER_KEY, False))


def sleeping_progress_thread(vllm_config: VllmConfig) -> contextlib.AbstractContextManager[None]:
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
