"""kvstage inside vLLM.

- `copy_blocks` (`copy_op`): vLLM's ``CopyBlocksOp``, byte-identical to vLLM's
  ``copy_kv_blocks``; torch only, importing it never imports vLLM.
- `KVStageConnector` (`connector`): the KV connector; it imports vLLM, so it loads on
  first access (``kv_connector_module_path: "kvstage.integrations.vllm"``), never when
  this package is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvstage.integrations.vllm.copy_op import copy_blocks

# KVStageConnector is left out of __all__: a star import must not import vLLM
__all__ = ["copy_blocks"]


def __getattr__(name: str) -> Any:
    if name == "KVStageConnector":
        connector = importlib.import_module(f"{__name__}.connector")
        return connector.KVStageConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
