"""`remote_compat_hash`: the connector asks a peer's vLLM NIXL handshake listener (vLLM's
own listener thread, serving a payload vLLM's encoder built) for its compatibility hash,
so a refusal is decided on that hash and never on vLLM's error text; the decode asks it
before vLLM's handshake, so a foreign peer is refused whatever that handshake would do."""

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

from kvstage.integrations.vllm import secure  # noqa: E402
from kvstage.integrations.vllm.connector import remote_compat_hash  # noqa: E402
from kvstage.integrations.vllm.worker import KVStageConnectorWorker  # noqa: E402
from kvstage.testing.vllm_engines import free_ports  # noqa: E402


@pytest.fixture
def listener(request: pytest.FixtureRequest) -> Iterator[tuple[int, str]]:
    compat = getattr(request, "param", "kvstage1:" + "ab" * 32)
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


def _decode_worker(handshakes: list[tuple[str, int]]) -> KVStageConnectorWorker:
    """A decode worker with only what its ``_nixl_handshake`` reads; the handshake proper
    (vLLM's, here the sealed one's slot) only records that it was reached."""
    worker = object.__new__(KVStageConnectorWorker)
    worker._kvstage_security = secure.Security(key=None)
    worker.compat_hash = "kvstage1:" + "ab" * 32

    def handshake(_w: object, host: str, port: int, *_a: object) -> tuple[dict, float]:
        handshakes.append((host, port))
        return {(0, 0): "agent"}, 0.0

    worker._kvstage_handshake = handshake
    return worker


@pytest.mark.parametrize("listener", ["ab" * 32], indirect=True)
def test_a_plain_nixl_peer_is_refused_before_vllms_handshake(
    listener: tuple[int, str],
) -> None:
    """A plain NixlConnector peer (its hash has no ``kvstage1:``) is refused on its hash,
    saying so, and vLLM's handshake is never started (it could fail otherwise: a slow
    listener gives zmq.Again, which names nothing)."""
    port, _ = listener
    handshakes: list[tuple[str, int]] = []
    with pytest.raises(RuntimeError, match="does not run kvstage's KV connector"):
        _decode_worker(handshakes)._nixl_handshake("127.0.0.1", port, 1, "engine-p")
    assert handshakes == []


def test_a_kvstage_peer_goes_on_to_the_handshake(listener: tuple[int, str]) -> None:
    port, _ = listener
    handshakes: list[tuple[str, int]] = []
    got = _decode_worker(handshakes)._nixl_handshake("127.0.0.1", port, 1, "engine-p")
    assert got == ({(0, 0): "agent"}, 0.0) and handshakes == [("127.0.0.1", port)]


def test_no_answer_leaves_it_to_the_handshake() -> None:
    """Nothing answers the probe: the handshake decides (here it is reached once)."""
    port = free_ports(1)[0]
    handshakes: list[tuple[str, int]] = []
    worker = _decode_worker(handshakes)
    worker._nixl_handshake("127.0.0.1", port, 1, "engine-p")
    assert handshakes == [("127.0.0.1", port)]
