"""The servers `bench.step_cost` serves side by side: each kind's ``--kv-transfer-config``,
and the arrangements of kinds started together on one core.

Arrangements (`ARRANGEMENTS`):
- ``four``: plain, kvstage consumer, kvstage producer, vLLM's NIXL consumer (host path);
- ``three``: plain and two kvstage consumers;
- ``pair-consumer`` / ``pair-producer``: plain and one kvstage consumer / producer;
- ``control``: two plain servers (A/A: what two identical servers differ by on this box);
- ``aab``: two plain servers and a kvstage consumer: the A/A and the A/B of one start side
  by side, for many starts (``--trials``);
- ``null``: plain, a server with a KV connector that does nothing (`bench.null_connector`:
  what vLLM's connector machinery costs any connector) and a kvstage consumer;
- ``four-no-nixl``: ``four`` with a second plain server in place of vLLM's NIXL consumer
  (whose busy-polling progress thread takes a core's share in ``four``).
"""

from __future__ import annotations

from typing import Any

from kvstage.serving.cluster import connector_config

__all__ = ["ARRANGEMENTS", "BENCH_CLASS", "KINDS", "KIND_EXTRA", "kv_config"]

#: server kind -> (connector, kv_role); None: plain. "bench": a connector of the bench's own
KINDS: dict[str, tuple[str, str] | None] = {
    "plain": None,
    "kvstage-consumer": ("kvstage", "kv_consumer"),
    "kvstage-producer": ("kvstage", "kv_producer"),
    "nixl-consumer": ("nixl", "kv_consumer"),
    "null-connector": ("bench", "kv_both"),  # vLLM's connector machinery only
}
#: kinds served by a connector class in the repository's bench/: (class, module)
BENCH_CLASS: dict[str, tuple[str, str]] = {
    "null-connector": ("NullConnector", "bench.null_connector"),
}
#: kv_connector_extra_config a kind adds to ``--kv-extra``'s
KIND_EXTRA: dict[str, dict[str, Any]] = {}
ARRANGEMENTS: dict[str, tuple[str, ...]] = {
    "four": ("plain", "kvstage-consumer", "kvstage-producer", "nixl-consumer"),
    "three": ("plain", "kvstage-consumer", "kvstage-consumer"),
    "pair-consumer": ("plain", "kvstage-consumer"),
    "pair-producer": ("plain", "kvstage-producer"),
    "control": ("plain", "plain"),  # A/A: the spread two identical servers show
    "aab": ("plain", "plain", "kvstage-consumer"),  # A/A and A/B in one start
    "null": ("plain", "null-connector", "kvstage-consumer"),  # vLLM's share, kvstage's
    "four-no-nixl": ("plain", "kvstage-consumer", "kvstage-producer", "plain"),
}


def kv_config(kind: str, extra: dict[str, Any]) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of a server of ``kind`` (None: plain); ``extra`` (and
    the kind's `KIND_EXTRA`) on kvstage servers only."""
    spec = KINDS[kind]
    if spec is None:
        return None
    connector, role = spec
    if connector == "bench":  # no kvstage settings: the connector reads none
        name, module = BENCH_CLASS[kind]
        return {"kv_connector": name, "kv_role": role, "kv_connector_module_path": module}
    if connector != "kvstage":
        return connector_config(connector, role, device="cpu", policy="fail")
    cfg = connector_config("kvstage", role, device="cpu", policy="fail",
                           extra={**extra, **KIND_EXTRA.get(kind, {})})
    assert cfg is not None
    if kind in BENCH_CLASS:
        cfg["kv_connector"], cfg["kv_connector_module_path"] = BENCH_CLASS[kind]
    return cfg
