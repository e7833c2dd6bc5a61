"""The shared key, per-request capabilities and notification checks of `KVStageConnector`.

Contract
--------
- Key (`Security.from_config`): ``kv_connector_extra_config["kvstage_key_file"]`` (a file
  readable by its owner only) or the ``KVSTAGE_KEY`` environment variable, loaded and checked
  by `kvstage.pd.auth.load_key` (the CLI's rules: mode 0600/0400, >= 16 bytes). Never a
  value in argv. Without a key, a non-loopback side-channel address
  (``VLLM_NIXL_SIDE_CHANNEL_HOST``) refuses to start unless
  ``"kvstage_allow_unauthenticated": true`` (`kvstage.pd.auth.check_bind`); on loopback
  it works as vLLM does and says once that the channel is unauthenticated.
- Capability: `kvstage.pd.auth.derived_capability` (the derived mode of kvstage's one
  capability: an HMAC of the engine id and request id under the key), so the prefill's
  scheduler (which hands it out) and its worker (which checks it) need no shared state. It travels
  inside the ``remote_request_id`` the prefill returns in ``kv_transfer_params``
  (``<id>#<32 hex>``, `kvstage.pd.auth.completion_notif`), so vLLM's decode puts it, unchanged,
  in every notification it sends for that request: ``<id>#<hex>:<consumers>`` when it is
  done, ``HB:<id>#<hex>,...`` as heartbeats.
- `NotificationGuard.verify_notif` turns one received notification into the plain form vLLM's
  parser expects (``<id>:<consumers>``, ``HB:<id>,...``) or None: with a key, one whose
  capability is missing or wrong is refused (it frees nothing, extends nothing); with or
  without a key, one vLLM's parser would crash on (not UTF-8, no ``:``, a non-numeric or
  out-of-range consumer count, over `MAX_NOTIF_BYTES`) is dropped. A replayed honest
  notification names a request vLLM already freed: vLLM ignores it. Limit: when several
  decode ranks read one prefill rank (decode TP > prefill TP), their notifications are
  identical, so one replayed before the others arrive counts as another rank's.
- `guard_notifications` installs the guard on one NIXL agent (its ``get_new_notifs``).

Threads: `NotificationGuard` is used by the worker's thread that calls ``get_new_notifs``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
MAX_NOTIF_BYTES = 1 << 16  # a heartbeat lists request ids: 64 KiB is ~1000 of them
MAX_CONSUMERS = 1 << 12  # vLLM's expected-consumer count: a TP ratio
_HEARTBEAT = "HB:"
_warned_unauthenticated = False


@dataclass(frozen=True)
class Security:
    """The key (None: unauthenticated, as vLLM) and the opt-in to run without one."""

    key: bytes | None
    allow_unauthenticated: bool = False

    @classmethod
    def from_config(cls, config: KVStageConfig, *,
                    side_channel_host: str | None = None) -> Security:
        """Load and check the key (``config``: the connector's settings, checked once by
        `config.KVStageConfig`); refuse (ValueError, one line) a non-loopback
        ``side_channel_host`` (default: vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST``) without one
        unless the user opted in."""
        if side_channel_host is None:
            from vllm import envs

            side_channel_host = envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        key = auth.load_key(config.key_file, os.environ)
        security = cls(key=key, allow_unauthenticated=config.allow_unauthenticated)
        security.check_address(side_channel_host, action="serve vLLM's NIXL side channel on")
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
                "kvstage: vLLM's NIXL side channel (%s) is not authenticated: any process "
                "that reaches it gets the NIXL agent metadata, can READ the host buffers and "
                "free requests' blocks. Give a shared key %s", host, HOW_TO_KEY)


def with_capability(key: bytes, engine_id: str, request_id: str) -> str:
    """``<request id>#<hex capability>``: the ``remote_request_id`` handed to the decode."""
    token = auth.derived_capability(key, engine_id, request_id)
    return auth.completion_notif(request_id, token).decode()


class NotificationGuard:
    """Checks the notifications one prefill (or decode) worker receives; see the module doc.

    Counters (for logs and tests): ``accepted``, ``refused`` (a missing or wrong
    capability), ``malformed`` (what vLLM's parser would crash on)."""

    def __init__(self, key: bytes | None, engine_id: str) -> None:
        self.key = key
        self.engine_id = engine_id
        self.accepted = 0
        self.refused = 0
        self.malformed = 0

    def verify_notif(self, notif: bytes) -> bytes | None:
        """vLLM's plain form of ``notif``, or None when it must be dropped."""
        text = self._text(notif)
        if text is None:
            self.malformed += 1
            self._log("malformed", notif)
            return None
        if text.startswith(_HEARTBEAT):
            ids = [self._request_id(e) for e in text[len(_HEARTBEAT):].split(",")]
            kept = [i for i in ids if i is not None]
            if not kept:
                self.refused += 1
                self._log("refused", notif)
                return None
            self.accepted += 1
            return (_HEARTBEAT + ",".join(kept)).encode()
        body, _, consumers = text.rpartition(":")
        rid = self._request_id(body)
        if rid is None:
            self.refused += 1
            self._log("refused", notif)
            return None
        self.accepted += 1
        return f"{rid}:{consumers}".encode()

    def filter(self, notifs: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        """`verify_notif` over what NIXL's ``get_new_notifs`` returns."""
        out: dict[str, list[bytes]] = {}
        for agent, msgs in notifs.items():
            kept = [m for m in (self.verify_notif(bytes(x)) for x in msgs) if m is not None]
            if kept:
                out[agent] = kept
        return out

    def _text(self, notif: bytes) -> str | None:
        if len(notif) > MAX_NOTIF_BYTES:
            return None
        try:
            text = notif.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if text.startswith(_HEARTBEAT):
            return text
        _, sep, consumers = text.rpartition(":")
        if not sep or not (consumers.isascii() and consumers.isdigit()) or not (
            1 <= int(consumers) <= MAX_CONSUMERS
        ):
            return None
        return text

    def _request_id(self, text: str) -> str | None:
        """The engine's request id ``text`` names, if its capability is right (or no key)."""
        if self.key is None:
            return text
        rid, token = auth.parse_notif(text.encode())
        if auth.same_capability(token, auth.derived_capability(self.key, self.engine_id, rid)):
            return rid
        return None

    def _log(self, what: str, notif: bytes) -> None:
        count = self.refused if what == "refused" else self.malformed
        if count <= 10 or count % 1000 == 0:  # bounded: a flood must not flood the log
            logger.warning(
                "kvstage: %s NIXL notification (%d so far, %d bytes, starts %r): %s",
                "refused a" if what == "refused" else "dropped a malformed", count,
                len(notif), notif[:48], "no valid capability for its request, nothing freed"
                if what == "refused" else "vLLM's parser would fail on it")


def guard_notifications(agent: Any, guard: NotificationGuard) -> None:
    """Make ``agent.get_new_notifs`` (vLLM's NIXL wrapper: the only way its worker reads
    notifications) return only what ``guard`` lets through."""
    fetch: Callable[..., dict[str, list[bytes]]] = agent.get_new_notifs

    def get_new_notifs(*args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        return guard.filter(fetch(*args, **kwargs))

    agent.get_new_notifs = get_new_notifs
