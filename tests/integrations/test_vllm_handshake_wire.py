"""Behaviour guards on vLLM's NIXL handshake wire, driven through vLLM's own code.

kvstage's listener (`secure_handshake.serve_handshake`) answers vLLM's REAL
``_nixl_handshake`` (its query, its two-frame reply parsing, its hash check and agent
registration, run on a stand-in worker) plainly, and sealed through `SealedHandshake`; vLLM's
REAL listener answers kvstage's query (and runs, unchanged, inside `serve_handshake`). A
vLLM that changes the query, the reply frames or the payload fails here, not in a serving
test. Neither end changes a vLLM module, and a vLLM whose ``_nixl_handshake`` or
``_nixl_handshake_listener`` source is not the recorded one is refused in one line.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnectorScheduler,
    NixlConnectorWorker,
    NixlHandshakePayload,
    base_scheduler,
    base_worker,
    utils,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
)

from kvstage.errors import HandshakeTimeout  # noqa: E402
from kvstage.integrations.vllm import secure_handshake, vllm_code  # noqa: E402
from kvstage.integrations.vllm.secure_handshake import (  # noqa: E402
    HandshakeRefused,
    SealedHandshake,
    serve_handshake,
)
from kvstage.testing.vllm_engines import free_ports  # noqa: E402

KEY = b"k" * 32
COMPAT = "kvstage1:" + "ef" * 32
AGENT = NixlAgentMetadata(
    engine_id="engine-p", agent_metadata=b"nixl-agent", kv_caches_base_addr=[4096],
    device_id=0, num_blocks=8, block_lens=[256], block_strides=[256], kv_cache_layout="NHD",
    block_size=16, ssm_sizes=(0, 0), attn_backend_name="TORCH_SDPA",
    physical_blocks_per_logical_kv_block=1,
)
PAYLOAD = NixlHandshakePayload(compatibility_hash=COMPAT,
                               agent_metadata_bytes=msgspec.msgpack.encode(AGENT))


class _Topo:
    def handshake_target_ranks(self, remote_tp_size: int, remote_dcp_size: int) -> list[int]:
        return [0]


class StandInWorker:
    """The attributes vLLM's ``_nixl_handshake`` reads; records the agents it adds."""

    _is_csa_linear = False
    use_host_buffer = True
    enforce_compat_hash = True

    def __init__(self, compat_hash: str = COMPAT) -> None:
        self.compat_hash = compat_hash
        self.transfer_topo = _Topo()
        self.added: list[tuple[str, bytes, int]] = []

    def _validate_remote_parallel_config(self, metadata: Any) -> None:
        del metadata

    def add_remote_agent(self, metadata: Any, remote_rank: int, remote_tp_size: int,
                         remote_dcp_size: int = 1) -> str:
        self.added.append((metadata.engine_id, bytes(metadata.agent_metadata), remote_rank))
        return "agent-p0"


def _serve(key: bytes | None) -> Iterator[int]:
    port = free_ports(1)[0]
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=serve_handshake, daemon=True,
                              args=({(0, 0): msgspec.msgpack.encode(PAYLOAD)}, ready, stop,
                                    "127.0.0.1", port), kwargs={"key": key})
    thread.start()
    assert ready.wait(10)
    yield port
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


@pytest.fixture
def keyed() -> Iterator[int]:
    yield from _serve(KEY)


@pytest.fixture
def unkeyed() -> Iterator[int]:
    yield from _serve(None)


def test_vllms_own_handshake_reads_kvstages_plain_listener(unkeyed: int) -> None:
    worker = StandInWorker()
    agents, offset = NixlConnectorWorker._nixl_handshake(worker, "127.0.0.1", unkeyed, 1,
                                                         "engine-p")
    assert agents == {(0, 0): "agent-p0"}
    assert worker.added == [("engine-p", b"nixl-agent", 0)]
    assert isinstance(offset, float)


def test_vllms_handshake_code_sealed_reads_the_keyed_listener(keyed: int) -> None:
    worker = StandInWorker()
    agents, offset = SealedHandshake(KEY)(worker, "127.0.0.1", keyed, 1, "engine-p")
    assert agents == {(0, 0): "agent-p0"}
    assert worker.added == [("engine-p", b"nixl-agent", 0)]
    assert isinstance(offset, float)


def test_sealed_with_another_key_is_refused_saying_the_keys_differ(keyed: int) -> None:
    worker = StandInWorker()
    with pytest.raises(HandshakeRefused, match="refused the handshake: 'side-channel "
                       "message has a wrong MAC: the keys differ'"):
        SealedHandshake(b"w" * 32)(worker, "127.0.0.1", keyed, 1, "engine-p")
    assert worker.added == []


def test_sealed_query_without_an_answer_says_where_within_vllms_bound() -> None:
    port = free_ports(1)[0]  # nothing listens
    with pytest.raises(HandshakeTimeout, match=rf"^no handshake answer from the prefill at "
                       rf"127\.0\.0\.1:{port} within 5 s: is the prefill instance up"):
        SealedHandshake(KEY)(StandInWorker(), "127.0.0.1", port, 1, "engine-p")


def test_vllms_own_handshake_gets_the_refusal_as_a_hash_mismatch(keyed: int) -> None:
    """A decode without the key: vLLM's own code reports the reason as the remote hash."""
    worker = StandInWorker()
    with pytest.raises(RuntimeError, match="Remote: kvstage-refused: this prefill requires "
                       "the shared key"):
        NixlConnectorWorker._nixl_handshake(worker, "127.0.0.1", keyed, 1, "engine-p")
    assert worker.added == []


def test_vllms_listener_answers_kvstages_query_in_two_frames() -> None:
    port = free_ports(1)[0]
    ready, stop = threading.Event(), threading.Event()
    encoded = {(0, 0): msgspec.msgpack.encode(PAYLOAD)}
    thread = threading.Thread(target=NixlConnectorScheduler._nixl_handshake_listener,
                              args=(encoded, ready, stop, "127.0.0.1", port), daemon=True)
    thread.start()
    assert ready.wait(10)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(secure_handshake._query(0, 0))
        frames = sock.recv_multipart()
    finally:
        sock.close(linger=0)
        stop.set()
        thread.join(5)
    assert len(frames) == 2
    assert msgspec.msgpack.decode(frames[0], type=NixlHandshakePayload) == PAYLOAD
    assert isinstance(msgspec.msgpack.decode(frames[1]), float)


def test_sealing_changes_no_vllm_module(unkeyed: int) -> None:
    """With the listener serving (``unkeyed``) and a sealed query built, vLLM's modules and
    functions still hold vLLM's ``zmq_ctx``."""
    vllm_ctx = utils.zmq_ctx
    SealedHandshake(KEY)
    assert base_worker.zmq_ctx is vllm_ctx and base_scheduler.zmq_ctx is vllm_ctx
    for func in vllm_code.handshake_functions():
        assert func.__globals__["zmq_ctx"] is vllm_ctx


@pytest.mark.parametrize("qualname", sorted(vllm_code.RECORDED))
def test_a_changed_vllm_handshake_refuses_to_start(qualname: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Either function changed: the worker's start check refuses, with or without a key."""
    digest = vllm_code.RECORDED[qualname]
    monkeypatch.setitem(vllm_code.RECORDED, qualname, "0" * 64)
    pattern = (rf"^kvstage cannot run vLLM \S+'s NIXL handshake on its sealed socket: "
               rf"{re.escape(qualname)} \(\S+\) is not the code kvstage recorded \(source "
               rf"sha256 {digest[:16]}, recorded 0000000000000000, vLLM 0.32.0, 0.33.0\); "
               r"run a supported vLLM$")
    for key in (KEY, None):
        with pytest.raises(RuntimeError, match=pattern):
            SealedHandshake.for_key(key)


def test_the_installed_vllm_is_the_recorded_one() -> None:
    vllm_code.check_vllm()
    assert SealedHandshake.for_key(None) is None


def test_the_digest_covers_the_source_lines() -> None:
    source = "class A:\n    def f(self):\n        return 1\n\n    def g(self):\n        pass\n"
    changed = source.replace("return 1", "return 2")
    assert vllm_code.source_sha256(source, "A.f") != vllm_code.source_sha256(changed, "A.f")
    assert vllm_code.source_sha256(source, "A.g") == vllm_code.source_sha256(changed, "A.g")
    with pytest.raises(LookupError, match="no A.h in that source"):
        vllm_code.source_sha256(source, "A.h")
