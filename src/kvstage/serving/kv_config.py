"""What a P/D deployment hands each vLLM instance: connector names, ``kv_transfer_config``,
free ports on 127.0.0.1 and the NIXL side-channel environment.

Contract: pure helpers, no vLLM import (kvstage's connector options are checked with
`kvstage.integrations.vllm.config`, which imports no vLLM either); used by
`kvstage.serving.cluster` and by the real-vLLM test harness (`kvstage.testing.vllm_engines`
re-exports them).
"""

from __future__ import annotations

from typing import Any

# Connectors the tests and benches compare: (class name, module path).
KVSTAGE_CONNECTOR = ("KVStageConnector", "kvstage.integrations.vllm")
VLLM_HOST_PATH_CONNECTOR = ("VLLMHostPathConnector", "kvstage.testing.vllm_baseline")


def kv_transfer_config(
    connector: tuple[str, str], role: str, **extra_config: Any
) -> dict[str, Any]:
    """A ``kv_transfer_config`` with the host path forced on (CPU platform). For kvstage's
    connector the options are checked as the connector will check them
    (`kvstage.integrations.vllm.config.KVStageConfig`: ValueError, one line per bad value)
    before any engine starts."""
    name, module = connector
    if connector == KVSTAGE_CONNECTOR:
        from kvstage.integrations.vllm.config import KVStageConfig

        KVStageConfig.parse(extra_config)
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": dict(extra_config),
    }


def free_ports(count: int, width: int = 1) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (HTTP and NIXL side channels);
    with ``width`` > 1, each is the first of ``width`` consecutive free ports (an instance
    at tensor-parallel size N listens on its side-channel port + rank, N ports).

    Picked at random BELOW the kernel's ephemeral range (``ip_local_port_range``, 32768 up
    here): a server binds its port tens of seconds after the pick (an engine loads first),
    and a port from the ephemeral range can meanwhile become the source port of any
    process's outgoing connection (seen: a prefill's side channel failed with "Address
    already in use" while other engines ran). All sockets stay bound until every port is
    picked: closing each one first could hand the same port out twice. Falls back to the
    kernel's choice if no such port binds.
    """
    import random
    import socket

    low = _ephemeral_low()
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        bases: list[int] = []
        for _ in range(count):
            for _attempt in range(64):
                base = rng.randrange(10000, low - width)
                run = _bind_run(base, width)
                if run:
                    socks += run
                    bases.append(base)
                    break
            else:
                if width != 1:
                    raise OSError(f"no {width} consecutive free ports found on 127.0.0.1")
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", 0))
                bases.append(int(s.getsockname()[1]))
        return bases
    finally:
        for s in socks:
            s.close()


def _bind_run(base: int, width: int) -> list[Any]:
    """Sockets bound on ``base`` .. ``base + width - 1`` of 127.0.0.1, or [] (none kept)."""
    import socket

    run: list[socket.socket] = []
    try:
        for port in range(base, base + width):
            s = socket.socket()
            run.append(s)
            s.bind(("127.0.0.1", port))
    except OSError:
        for s in run:
            s.close()
        return []
    return run


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), else IANA's 49152."""
    try:
        from pathlib import Path

        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        low = int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
    return low if low > 10100 else 49152


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
