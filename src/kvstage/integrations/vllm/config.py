"""`KVStageConfig`: every setting `KVStageConnector` reads, parsed and checked once.

Contract
--------
- `KVStageConfig.parse(extra, ...)`: ``kv_connector_extra_config`` (a mapping, or None) plus
  the vLLM settings the connector reads (``kv_buffer_device``, ``enable_permute_local_kv``)
  into one frozen object. Every bad value is reported, one line each, in ONE `ValueError`
  (``kv_connector_extra_config key=value: expected ...``); an unknown ``kvstage_*`` key is
  refused with the list of known ones; a removed key (`REMOVED`) is refused saying why.
  Keys vLLM itself reads are left to it, except ``kv_lease_duration``, parsed here with
  vLLM's default (30): the prefill's lease, the decode's heartbeat period (a third of it)
  and its handshake and READ bounds (half of it).
- `KVStageConfig.from_vllm(vllm_config)`: the same from a ``VllmConfig`` (read by attribute:
  importing this module never imports vLLM). The connector builds it once per role
  object (scheduler, worker) and hands it to the pieces.
- `KEYS`: ``(name, type, default, range, meaning)`` per key: README's table is this table.

No thread, no state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstage.transport.nixl_agent import MAX_PROGRESS_DELAY_US

LOG_PREFIX = "kvstage READ"
#: the line ``kvstage_log_reads`` writes per READ: bytes, xfer_us (posted to last chunk
#: done), nixl_post_us, nixl_descs (groups 1-4; what the benches parse)
READ_LOG = re.compile(
    LOG_PREFIX + r" bytes=(\d+) xfer_us=(\d+) nixl_post_us=(\d+) nixl_descs=(\d+)")

#: the NIXL progress thread's wait when idle, in the connector (the CLI roles keep 1 ms).
#: The thread waits on UCX's event fd with this timeout, so traffic wakes it at once; only
#: idle wake-ups depend on it (what they cost a neighbour: BENCHMARKS "What does the
#: connector cost against plain vLLM?")
PROGRESS_DELAY_US = 20_000
LEASE_DEFAULT_S = 30  # vLLM's default kv_lease_duration (NixlBaseConnectorScheduler)
REMOVED = {
    "kvstage_force_host_buffer": "kvstage_force_host_buffer was removed: KVStageConnector "
                                 "always stages KV through host memory, on every platform; "
                                 "drop the key",
    "kvstage_merge_reads": "kvstage_merge_reads was removed: a READ posts one descriptor per "
                           "run of blocks already; drop the key",
    "kvstage_quiet_poll_ms": "kvstage_quiet_poll_ms was removed: the connector does no work "
                             "in a step that carries none, on every step; drop the key",
    "kvstage_lease_margin_s": "kvstage_lease_margin_s was removed: the prefill decides on its "
                              "own clock (the decode's Acquire renews the lease or is "
                              "refused), no margin is guessed; drop the key",
}

#: (key, type, default, range, meaning): the README table
KEYS: tuple[tuple[str, str, str, str, str], ...] = (
    ("kvstage_key_file", "str", "none", "a file of mode 600/400, >= 16 bytes",
     "the shared key (or KVSTAGE_KEY): seals the handshake, capabilities on notifications"),
    ("kvstage_allow_unauthenticated", "bool", "false", "true/false",
     "run without a key on a non-loopback side channel"),
    ("kvstage_verify_checksum", "bool", "false", "true/false",
     "xxh3-64 of each block, per rank, prefill to decode, checked before the h2d"),
    ("kvstage_progress_delay_us", "int", str(PROGRESS_DELAY_US),
     f"0..{MAX_PROGRESS_DELAY_US}", "NIXL progress-thread sleep when idle (0: busy poll)"),
    ("kvstage_log_reads", "bool", "false", "true/false",
     "log each READ's NIXL figures (bytes, microseconds, descriptors)"),
    ("kvstage_save_by_chunk", "bool", "true", "true/false",
     "prefill: copy each chunk's completed blocks to the host while later chunks run "
     "(false: the whole prompt in its last step)"),
    ("kvstage_time_hooks", "bool", "false", "true/false",
     "time each vLLM hook the connector serves (vllm:kvstage_hook_seconds_total; a "
     "diagnostic: a wrapper per hook call)"),
    ("kvstage_peer_tp_size", "int", "this instance's TP size", "1..1024",
     "the other side's TP size (a prefill's decodes, a decode's prefills): another than "
     "this instance's cuts each page into the head slices the pair reads"),
    ("kv_lease_duration", "number (vLLM's)", str(LEASE_DEFAULT_S), "> 0, finite",
     "prefill: seconds a finished request's blocks are held for the decode, renewed by the "
     "decode's heartbeat up to 4 leases; the decode's handshake and READ bound: half of it"),
)
KNOWN = tuple(k for k, *_ in KEYS if k.startswith("kvstage_"))


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _number(value: Any, low: float, *, strict: bool = False) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < low or (strict and value == low):
        return None
    return float(value)


@dataclass(frozen=True, kw_only=True)
class KVStageConfig:
    """The connector's settings (see `KEYS` for each one's meaning)."""

    key_file: str | None = None
    allow_unauthenticated: bool = False
    verify_checksum: bool = False
    progress_delay_us: int = PROGRESS_DELAY_US
    log_reads: bool = False
    save_by_chunk: bool = True
    time_hooks: bool = False
    lease_duration_s: float = float(LEASE_DEFAULT_S)
    peer_tp_size: int = 0  # 0: this instance's TP size

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, *, kv_buffer_device: str = "cpu",
              permute_local_kv: bool = False) -> KVStageConfig:
        extra = dict(extra or {})
        bad: list[str] = []

        def refuse(key: str, expected: str) -> None:
            bad.append(f"kv_connector_extra_config {key}={extra[key]!r}: expected {expected}")

        out: dict[str, Any] = {}
        for key, field in (("kvstage_allow_unauthenticated", "allow_unauthenticated"),
                           ("kvstage_verify_checksum", "verify_checksum"),
                           ("kvstage_log_reads", "log_reads"),
                           ("kvstage_save_by_chunk", "save_by_chunk"),
                           ("kvstage_time_hooks", "time_hooks")):
            if key in extra:
                value = _bool(extra[key])
                if value is None:
                    refuse(key, "true or false")
                else:
                    out[field] = value
        if "kvstage_key_file" in extra:
            path = extra["kvstage_key_file"]
            if path is not None and not (isinstance(path, str) and path):
                refuse("kvstage_key_file", "a path string")
            else:
                out["key_file"] = path
        lease = float(LEASE_DEFAULT_S)
        if "kv_lease_duration" in extra:
            number = _number(extra["kv_lease_duration"], 0.0, strict=True)
            if number is None:
                refuse("kv_lease_duration", "a number of seconds > 0")
            else:
                lease = number
        out["lease_duration_s"] = lease
        for key, field, high, unit in (
                ("kvstage_progress_delay_us", "progress_delay_us", MAX_PROGRESS_DELAY_US,
                 "microseconds; 0: NIXL's busy poll"),
                ("kvstage_peer_tp_size", "peer_tp_size", 1024, "the other side's TP size")):
            if key in extra:
                value = extra[key]
                low = 1 if field == "peer_tp_size" else 0
                if isinstance(value, bool) or not isinstance(value, int) or not (
                        low <= value <= high):
                    refuse(key, f"an int {low}..{high} ({unit})")
                else:
                    out[field] = value
        for key in extra:
            if key in REMOVED:
                bad.append(f"kv_connector_extra_config {key}={extra[key]!r}: {REMOVED[key]}")
            elif key.startswith("kvstage_") and key not in KNOWN:
                bad.append(f"kv_connector_extra_config {key}={extra[key]!r}: unknown kvstage "
                           f"key; known: {', '.join(KNOWN)}")
        if kv_buffer_device != "cpu":
            bad.append(f"kv_buffer_device={kv_buffer_device!r}: expected 'cpu' (KVStageConnector "
                       "stages KV through host memory; use NixlConnector for device-to-device)")
        if permute_local_kv:
            bad.append("enable_permute_local_kv=True: expected false (vLLM's heterogeneous-TP "
                       "permute is NixlConnector's; KVStageConnector does not use it)")
        if bad:
            raise ValueError("KVStageConnector: " + "\n".join(bad))
        return cls(**out)

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> KVStageConfig:
        """From vLLM's ``VllmConfig`` (its ``kv_transfer_config``)."""
        kv = vllm_config.kv_transfer_config
        assert kv is not None
        return cls.parse(
            kv.kv_connector_extra_config, kv_buffer_device=kv.kv_buffer_device,
            permute_local_kv=bool(getattr(kv, "enable_permute_local_kv", False)),
        )
