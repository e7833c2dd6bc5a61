"""What kvstage hands from a prefill to a decode per request: one versioned schema.

Contract
--------
- Wire: ONE key of vLLM's ``kv_transfer_params``, ``"kvstage"`` (JSON-safe: routers parse
  and forward the params), ``{"v": 1, "lease_expires": <float>, "lease_extension_s":
  <float>, "checksums": {"xxh3_64": {"<block id>": "<16 hex>"}}}``; each field optional.
  ``lease_expires``: the end of the prefill's lease on the request's blocks in its
  scheduler's ``perf_counter`` seconds; ``lease_extension_s``: how far a decode's heartbeat
  moves it (`lease`); ``checksums``: one digest per saved block (`checksums`; the form of
  `kvstage.pd.integrity.to_params`).
- `RequestParams`: the decoded, checked value (frozen); `encode` / `decode` are each
  other's inverse. `decode` of a value that is not this schema (an unknown version, a field
  of the wrong type, a non-finite time, over `MAX_BLOCKS` digests, a digest that is not 16
  hex digits) raises `ValueError`, one line naming the field, what arrived and what is
  expected. An absent key is `RequestParams()` (a prefill without kvstage's fields).
- `pack(params)`: moves the per-feature keys the feature modules write on the prefill
  (``kvstage_lease_expires``, ``kvstage_lease_extension_s``, ``kvstage_checksums``) into
  the one versioned key, in place.
- On the decode, the scheduler hands the decoded values to its worker in ONE typed field of
  the step's metadata (`scheduler.KVStageConnectorMetadata.requests`).

No thread, no state, no vLLM import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstage.pd.integrity import CHECKSUM, to_params

VERSION = 1
KEY = "kvstage"
LEASE_KEY = "kvstage_lease_expires"  # written by lease.stamp, packed here
EXTENSION_KEY = "kvstage_lease_extension_s"  # written by lease.stamp, packed here
CHECKSUMS_KEY = "kvstage_checksums"  # written by checksums.SchedulerChecksums, packed here
MAX_BLOCKS = 1 << 20  # digests per request: a 1M-block prompt is far beyond any pool here
_HEX16 = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class RequestParams:
    """One request's kvstage fields (see the module doc)."""

    lease_expires: float | None = None
    lease_extension_s: float | None = None  # a heartbeat's extension on the prefill
    checksums: Mapping[int, int] | None = None  # block id -> xxh3-64

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": VERSION}
        if self.lease_expires is not None:
            out["lease_expires"] = self.lease_expires
        if self.lease_extension_s is not None:
            out["lease_extension_s"] = self.lease_extension_s
        if self.checksums is not None:
            out["checksums"] = to_params(dict(self.checksums))
        return out


def _refuse(field_name: str, value: Any, expected: str) -> ValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ValueError(f"kv_transfer_params[{KEY!r}] {field_name}={shown}: expected {expected}")


def decode(value: Any) -> RequestParams:
    """`RequestParams` from the ``"kvstage"`` value of ``kv_transfer_params`` (None: none)."""
    if value is None:
        return RequestParams()
    if not isinstance(value, dict):
        raise _refuse("", value, f'an object {{"v": {VERSION}, ...}}')
    if value.get("v") != VERSION:
        raise _refuse("v", value.get("v"), f"version {VERSION} (the decode runs kvstage "
                      f"protocol {VERSION}; run one kvstage version on both instances)")
    unknown = sorted(set(value) - {"v", "lease_expires", "lease_extension_s", "checksums"})
    if unknown:
        raise _refuse(unknown[0], value[unknown[0]],
                      "one of v, lease_expires, lease_extension_s, checksums")
    extension = value.get("lease_extension_s")
    if extension is not None and (isinstance(extension, bool) or not isinstance(
            extension, int | float) or not math.isfinite(extension) or extension < 0):
        raise _refuse("lease_extension_s", extension, "a finite number of seconds >= 0")
    lease = value.get("lease_expires")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int | float)
                              or not math.isfinite(lease)):
        raise _refuse("lease_expires", lease, "a finite number of seconds")
    digests: dict[int, int] | None = None
    if "checksums" in value:
        table = value["checksums"]
        rows = table.get(CHECKSUM) if isinstance(table, dict) and len(table) == 1 else None
        if not isinstance(rows, dict):
            raise _refuse("checksums", table, f'{{"{CHECKSUM}": {{"<block id>": "<hex>"}}}}')
        if len(rows) > MAX_BLOCKS:
            raise _refuse("checksums", f"<{len(rows)} blocks>", f"at most {MAX_BLOCKS} blocks")
        digests = {}
        for b, d in rows.items():
            if not (isinstance(b, str) and b.isascii() and b.isdigit()) or not (
                    isinstance(d, str) and _HEX16.fullmatch(d)):
                raise _refuse("checksums", {b: d}, "decimal block ids to 16 hex digits")
            digests[int(b)] = int(d, 16)
    return RequestParams(lease_expires=None if lease is None else float(lease),
                         lease_extension_s=None if extension is None else float(extension),
                         checksums=digests)


def pack(params: dict[str, Any] | None) -> None:
    """Move the feature modules' keys of ``params`` into the one versioned key (in place)."""
    if params is None or not any(k in params for k in (LEASE_KEY, EXTENSION_KEY,
                                                        CHECKSUMS_KEY)):
        return
    current = decode(params.get(KEY))
    lease = params.pop(LEASE_KEY, current.lease_expires)
    extension = params.pop(EXTENSION_KEY, current.lease_extension_s)
    digests = current.checksums
    if CHECKSUMS_KEY in params:
        digests = decode({"v": VERSION, "checksums": params.pop(CHECKSUMS_KEY)}).checksums
    params[KEY] = RequestParams(lease_expires=lease, lease_extension_s=extension,
                                checksums=digests).encode()
