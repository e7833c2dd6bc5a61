"""One host's part of a P/D deployment: its prefill or decode api_servers, or the router.

Operators run prefill and decode on different hosts, each under its own supervisor, with
the router on yet another. Contract:
- `host_instances(role, model, ...)`: this host's ``count`` api_servers of one role (not
  started), bound to ``host`` (their HTTP server, NIXL side channel and ``VLLM_HOST_IP``:
  the address peers use), HTTP ports ``port + i`` and side-channel ports
  ``side_channel_port + i * tp`` (rank r of instance i on that + r); on CPU pinned to
  this process's cores (`placement.place_ranks`), on CUDA ``tp`` GPUs each
  (`placement.gpu_assignment`).
- `host_router(prefill_urls, decode_urls, ...)`: vllm-router in front of instances on
  other hosts (not started).
- `check_keyed(host, kv_extra)`: an address other machines can reach needs the shared key
  (``kvstage_key_file`` in the connector options, or ``KVSTAGE_KEY`` in the environment)
  unless ``kvstage_allow_unauthenticated`` is true; refused in one line (`ServingError`)
  before anything starts, as the connector would refuse at its start.
- `check_url(text)`: a peer URL ``http://HOST:PORT`` (what the router is given).
No vLLM import: this module only builds process descriptions.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path
from typing import Any

from kvstage.serving.cluster import api_server_instance, connector_config, router_instance
from kvstage.serving.engine_args import EngineArgs
from kvstage.serving.instances import Instance, ServingError
from kvstage.serving.kv_config import is_loopback
from kvstage.serving.placement import gpu_assignment, place_ranks

ROLES = ("prefill", "decode", "router")


def check_keyed(host: str, kv_extra: dict[str, Any]) -> None:
    if is_loopback(host):
        return
    if kv_extra.get("kvstage_key_file") or os.environ.get("KVSTAGE_KEY"):
        return
    if kv_extra.get("kvstage_allow_unauthenticated") is True:
        return
    raise ServingError(
        f"--host {host} is reachable from other machines and no key is given: pass the "
        "shared key file (--key-file FILE, the same file on every host) or, on a trusted "
        "network only, --kv-extra kvstage_allow_unauthenticated=true")


def check_url(text: str) -> str:
    parsed = urllib.parse.urlsplit(text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise ServingError(f"expected an instance URL like http://10.0.0.2:8100, got "
                           f"{text[:80]!r}")
    return text.rstrip("/")


def host_instances(role: str, model: str, *, count: int, host: str, port: int,
                   side_channel_port: int, engine_args: EngineArgs, connector: str,
                   policy: str, kv_extra: dict[str, Any], device: str, log_dir: Path,
                   share_gpus: bool = False, tp: int = 1) -> list[Instance]:
    if role not in ROLES[:2]:
        raise ServingError(f"api_server role must be one of {ROLES[:2]}, got {role!r}")
    check_keyed(host, kv_extra)
    if port + count - 1 > 65535 or side_channel_port + count * tp - 1 > 65535:
        raise ServingError(f"{count} instances from port {port} / side channel "
                           f"{side_channel_port} run past 65535; pick lower ports")
    kv = connector_config(connector, "kv_producer" if role == "prefill" else "kv_consumer",
                          device=device, policy=policy, extra=kv_extra or None)
    cores = place_ranks(sorted(os.sched_getaffinity(0)), count, 0, tp, tp)
    gpus: list[str | None] = (list(gpu_assignment(count, share=share_gpus, tps=[tp] * count))
                              if device == "cuda" else [None] * count)
    return [  # instance i's ranks: side channel ports side_channel_port + i * tp + rank
        api_server_instance(f"{role}{i}", role, model, port=port + i, log_dir=log_dir,
                            engine_args=engine_args, kv_config=kv, device=device,
                            rank_cores=cores[i], gpu=gpus[i],
                            side_channel_port=side_channel_port + i * tp, host=host)
        for i in range(count)
    ]


def host_router(prefill_urls: list[str], decode_urls: list[str], *, host: str, port: int,
                metrics_port: int, log_dir: Path, extra: tuple[str, ...] = (),
                policy: str = "round_robin") -> Instance:
    if not prefill_urls or not decode_urls:
        raise ServingError("the router needs at least one --prefill-url and one --decode-url "
                           "(the instances' http://HOST:PORT)")
    return router_instance([check_url(u) for u in prefill_urls],
                           [check_url(u) for u in decode_urls], port=port,
                           metrics_port=metrics_port, log_dir=log_dir, policy=policy,
                           extra=extra, host=host)
