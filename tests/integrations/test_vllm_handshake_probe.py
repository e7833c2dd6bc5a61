"""`remote_compat_hash`: the connector asks a peer's vLLM NIXL handshake listener (vLLM's
own listener thread, serving a payload vLLM's encoder built) for its compatibility hash,
so a refusal is decided on that hash and never on vLLM's error text."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnectorScheduler,
    NixlHandshakePayload,
)

from kvstage.integrations.vllm.connector import remote_compat_hash  # noqa: E402
from kvstage.testing.vllm_engines import free_ports  # noqa: E402


@pytest.fixture
def listener() -> Iterator[tuple[int, str]]:
    compat = "kvstage1:" + "ab" * 32
    payload = NixlHandshakePayload(compatibility_hash=compat, agent_metadata_bytes=b"m" * 64)
    encoded = {(0, 0): msgspec.msgpack.Encoder().encode(payload)}
    port = free_ports(1)[0]
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=NixlConnectorScheduler._nixl_handshake_listener,
                              args=(encoded, ready, stop, "127.0.0.1", port), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield port, compat
    stop.set()
    thread.join(5)


def test_reads_the_hash_a_vllm_listener_serves(listener: tuple[int, str]) -> None:
    port, compat = listener
    assert remote_compat_hash("127.0.0.1", port) == compat


def test_nothing_listening_is_none_within_the_bound() -> None:
    port = free_ports(1)[0]
    start = time.monotonic()
    assert remote_compat_hash("127.0.0.1", port, timeout_s=0.3) is None
    assert time.monotonic() - start < 3


def test_a_peer_answering_something_else_is_none() -> None:
    """A listener that answers with bytes that are no handshake payload."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if sock.poll(50):
                ident, empty, _msg = sock.recv_multipart()
                sock.send_multipart([ident, empty, b"\xc1 not msgpack"])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert remote_compat_hash("127.0.0.1", port, timeout_s=5) is None
    finally:
        stop.set()
        thread.join(5)
        sock.close(linger=0)
