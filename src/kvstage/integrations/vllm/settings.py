"""The wire's protocol tag and the NIXL agent vLLM creates with kvstage's progress delay.

Contract: `HASH_PREFIX` starts every kvstage compatibility hash; `sleeping_progress_thread`
wraps the construction of vLLM's NIXL agent in kvstage's progress-thread delay (the one
runtime replacement of NIXL's bindings, undone when the agent exists). Settings themselves
are `config.KVStageConfig`. Imports vLLM (loaded only with the connector).
"""

from __future__ import annotations

import contextlib
import sys

from vllm.distributed.nixl_utils import NixlWrapper

from kvstage.transport.nixl_agent import progress_delay

#: Bumped whenever the bytes kvstage puts on the wire change meaning.
KVSTAGE_PROTOCOL = 1
HASH_PREFIX = f"kvstage{KVSTAGE_PROTOCOL}:"


def sleeping_progress_thread(delay_us: int) -> contextlib.AbstractContextManager[None]:
    """`kvstage.transport.nixl_agent.progress_delay` around the NIXL wrapper vLLM uses
    (``kvstage_progress_delay_us``, checked by `config.KVStageConfig`; 0 keeps NIXL's busy
    loop). A NIXL without that wrapper shape is left as it is."""
    api = sys.modules.get(getattr(NixlWrapper, "__module__", ""), None)
    if api is None or not hasattr(api, "nixlBind"):
        return contextlib.nullcontext()
    return progress_delay(api, delay_us)
