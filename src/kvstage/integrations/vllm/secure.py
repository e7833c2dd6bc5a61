"""The shared key of `KVStageConnector`, and where the connector may run without one.

Contract
--------
- Key (`Security.from_config`): ``kv_connector_extra_config["kvstage_key_file"]`` (a file
  readable by its owner only) or the ``KVSTAGE_KEY`` environment variable, loaded and checked
  by `kvstage.pd.auth.load_key` (the CLI's rules: mode 0600/0400, >= 16 bytes). Never a
  value in argv. Without a key, a non-loopback side-channel address
  (``VLLM_NIXL_SIDE_CHANNEL_HOST``) refuses to start unless
  ``"kvstage_allow_unauthenticated": true`` (`kvstage.pd.auth.check_bind`); on loopback
  it works and says once that the channel is unauthenticated.
- With the key, the pd/ roles seal every side-channel message (`kvstage.pd.auth`) and the
  request's capability (`metadata.capability_of`, derived from the key) is what frees or
  renews a held request; a notification without it frees nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstage.pd import auth

if TYPE_CHECKING:
    from kvstage.integrations.vllm.config import KVStageConfig

logger = logging.getLogger(f"vllm.{__name__}")

KEY_FILE_KEY = "kvstage_key_file"
ALLOW_UNAUTHENTICATED_KEY = "kvstage_allow_unauthenticated"
#: how to give the key, in the words of a vLLM user (for refusals)
HOW_TO_KEY = (
    f"(the {auth.KEY_ENV} environment variable, or kv_connector_extra_config "
    f'{{"{KEY_FILE_KEY}": "/path/to/key"}}, a file of mode 600) to prefill and decode'
)
_warned_unauthenticated = False


@dataclass(frozen=True)
class Security:
    """The key (None: unauthenticated, as vLLM) and the opt-in to run without one."""

    key: bytes | None
    allow_unauthenticated: bool = False

    @classmethod
    def from_config(cls, config: KVStageConfig, *,
                    side_channel_host: str = "localhost") -> Security:
        """Load and check the key (``config``: the connector's settings, checked once by
        `config.KVStageConfig`); refuse (ValueError, one line) a non-loopback
        ``side_channel_host`` without one unless the user opted in."""
        key = auth.load_key(config.key_file, os.environ)
        security = cls(key=key, allow_unauthenticated=config.allow_unauthenticated)
        security.check_address(side_channel_host, action="serve the side channel on")
        return security

    def check_address(self, host: str, *, action: str) -> None:
        """`auth.check_bind` for ``host``; without a key, says once per process that the
        side channel is unauthenticated."""
        auth.check_bind(host, self.key, insecure=self.allow_unauthenticated, action=action,
                        fix=f"{HOW_TO_KEY}, or set "
                            f'"{ALLOW_UNAUTHENTICATED_KEY}": true in kv_connector_extra_config')
        global _warned_unauthenticated
        if self.key is None and not _warned_unauthenticated:
            _warned_unauthenticated = True
            logger.warning(
                "kvstage: the side channel (%s) is not authenticated: any process that "
                "reaches it gets the NIXL agent metadata, can READ the host buffers and "
                "free requests' blocks. Give a shared key %s", host, HOW_TO_KEY)
