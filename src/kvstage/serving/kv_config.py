"""What a P/D deployment hands each vLLM instance: connector names, ``kv_transfer_config``,
free ports on 127.0.0.1 and the NIXL side-channel environment.

Contract: pure helpers, no vLLM import; used by `kvstage.serving.cluster` and by the
real-vLLM test harness (`kvstage.testing.vllm_engines` re-exports them).
"""

from __future__ import annotations

from typing import Any

# Connectors the tests and benches compare: (class name, module path).
KVSTAGE_CONNECTOR = ("KVStageConnector", "kvstage.integrations.vllm")
VLLM_HOST_PATH_CONNECTOR = ("VLLMHostPathConnector", "kvstage.testing.vllm_baseline")


def kv_transfer_config(
    connector: tuple[str, str], role: str, **extra_config: Any
) -> dict[str, Any]:
    """A ``kv_transfer_config`` with the host path forced on (CPU platform)."""
    name, module = connector
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kvstage_force_host_buffer": True, **extra_config},
    }


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (NIXL side channels).

    All sockets stay bound until every port is picked: closing each one first would let the
    kernel hand the same port out twice.
    """
    import socket

    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def side_channel_env(port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """vLLM's NIXL side channel of one instance: the address its peers reach it on."""
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_HOST": host}


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
