"""The connector's key settings, capabilities, notification checks and sealed handshake
listener, in-process: kvstage's listener runs in a thread with vLLM's arguments, queried as
vLLM's handshake and kvstage's `fetch_payload` query it. The same attacks on real engines:
tests/system/vllm/test_vllm_side_channel_auth.py."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlHandshakePayload  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG  # noqa: E402

from kvstage.integrations.vllm import secure  # noqa: E402
from kvstage.integrations.vllm.config import KVStageConfig  # noqa: E402
from kvstage.integrations.vllm.connector import remote_compat_hash  # noqa: E402
from kvstage.integrations.vllm.secure_handshake import (  # noqa: E402
    HandshakeRefused,
    fetch_payload,
    serve_handshake,
)
from kvstage.pd.auth import Authenticator, derived_capability  # noqa: E402
from kvstage.pd.side_channel import send_raw  # noqa: E402
from kvstage.testing.vllm_engines import free_ports  # noqa: E402

KEY = b"k" * 32
ENGINE = "engine-a"


def _config(**extra: object) -> KVStageConfig:
    return KVStageConfig.parse(extra)  # the connector's settings, as it parses them


@pytest.fixture(scope="module")
def config() -> KVStageConfig:
    return _config()


# -- the key ------------------------------------------------------------------------------
def test_key_from_the_environment(config: KVStageConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTAGE_KEY", KEY.decode())
    assert secure.Security.from_config(config, side_channel_host="10.1.2.3").key == KEY


def test_key_file_wins_and_must_be_private(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTAGE_KEY", KEY.decode())
    path = tmp_path / "key"
    path.write_bytes(b"f" * 24 + b"\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by group or others.*chmod 600"):
        secure.Security.from_config(_config(kvstage_key_file=str(path)))
    path.chmod(0o600)
    assert secure.Security.from_config(_config(kvstage_key_file=str(path))).key == b"f" * 24


def test_no_key_off_loopback_refuses_unless_opted_in(
    config: KVStageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"refusing to serve vLLM's NIXL side channel on "
                       r"10\.1\.2\.3 without a key.*kvstage_allow_unauthenticated"):
        secure.Security.from_config(config, side_channel_host="10.1.2.3")
    opted = secure.Security.from_config(_config(kvstage_allow_unauthenticated=True),
                                        side_channel_host="10.1.2.3")
    assert opted.key is None


def test_no_key_on_loopback_works_and_says_so_once(
    config: KVStageConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)
    monkeypatch.setattr(secure, "_warned_unauthenticated", False)
    logging.getLogger(secure.logger.name).propagate = True
    with caplog.at_level(logging.WARNING, logger=secure.logger.name):
        for host in ("127.0.0.1", "localhost", "127.0.0.1"):
            assert secure.Security.from_config(config, side_channel_host=host).key is None
    assert [r.getMessage().count("is not authenticated") for r in caplog.records] == [1]


def test_bad_settings_are_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)
    with pytest.raises(ValueError, match="kvstage_allow_unauthenticated='yes': expected true "
                                         "or false"):
        secure.Security.from_config(_config(kvstage_allow_unauthenticated="yes"))
    with pytest.raises(ValueError, match="kvstage_key_file=3: expected a path string"):
        secure.Security.from_config(_config(kvstage_key_file=3))
    monkeypatch.setenv("KVSTAGE_KEY", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        secure.Security.from_config(_config())


# -- capabilities and notifications ---------------------------------------------------------
def test_capability_is_per_key_engine_and_request() -> None:
    cap = derived_capability(KEY, ENGINE, "r1")
    assert len(cap) == 16
    assert cap == derived_capability(KEY, ENGINE, "r1")
    others = {derived_capability(b"x" * 32, ENGINE, "r1"), derived_capability(KEY, "b", "r1"),
              derived_capability(KEY, ENGINE, "r2")}
    assert cap not in others and len(others) == 3
    assert secure.with_capability(KEY, ENGINE, "r1") == "r1#" + cap.hex()


def test_keyed_guard_passes_only_the_capability_holder() -> None:
    guard = secure.NotificationGuard(KEY, ENGINE)
    rid = secure.with_capability(KEY, ENGINE, "req-1")
    other = secure.with_capability(KEY, "engine-b", "req-1")
    assert guard.verify_notif(f"{rid}:1".encode()) == b"req-1:1"
    assert guard.verify_notif(f"{rid}:2".encode()) == b"req-1:2"
    for forged in (b"req-1:1", f"req-1#{'00' * 16}:1".encode(), f"{other}:1".encode(),
                   b"req-1#:1", f"{rid}x:1".encode(), b"HB:req-1"):
        assert guard.verify_notif(forged) is None
    # heartbeats keep only the ids whose capability is right
    hb = f"HB:{rid},req-2,{secure.with_capability(KEY, ENGINE, 'req-3')}".encode()
    assert guard.verify_notif(hb) == b"HB:req-1,req-3"
    assert (guard.accepted, guard.refused, guard.malformed) == (3, 6, 0)


@pytest.mark.parametrize("key", [KEY, None])
def test_guard_drops_what_vllms_parser_would_crash_on(key: bytes | None) -> None:
    guard = secure.NotificationGuard(key, ENGINE)
    for garbage in (b"\xff\xfe:1", b"no-separator", b"x:not-a-number", b"x:0", b"x:-1",
                    b"x:99999", b"x:\xd9\xa3", b"x" * 70000 + b":1"):
        assert guard.verify_notif(garbage) is None
    assert guard.malformed == 8


def test_unkeyed_guard_keeps_vllms_notifications_as_they_are() -> None:
    guard = secure.NotificationGuard(None, ENGINE)
    assert guard.verify_notif(b"req-1:1") == b"req-1:1"
    assert guard.verify_notif(b"HB:a,b") == b"HB:a,b"
    assert guard.filter({"p": [b"a:1", b"\xff:1"], "q": [b"junk"]}) == {"p": [b"a:1"]}


def test_guard_installs_on_an_agent_instance() -> None:
    class Agent:  # the shape of vLLM's NIXL wrapper that the guard touches
        def get_new_notifs(self) -> dict[str, list[bytes]]:
            return {"decode": [b"a:1", f"{secure.with_capability(KEY, ENGINE, 'b')}:1".encode()]}

    agent = Agent()
    secure.guard_notifications(agent, secure.NotificationGuard(KEY, ENGINE))
    assert agent.get_new_notifs() == {"decode": [b"b:1"]}


# -- the sealed handshake listener ----------------------------------------------------------
PAYLOAD = NixlHandshakePayload(compatibility_hash="kvstage1:" + "cd" * 32,
                               agent_metadata_bytes=b"agent-metadata" * 8)


def _serve(key: bytes | None) -> Iterator[int]:
    encoded = {(0, 0): msgspec.msgpack.encode(PAYLOAD)}
    port = free_ports(1)[0]
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=serve_handshake, daemon=True,
                              args=(encoded, ready, stop, "127.0.0.1", port),
                              kwargs={"key": key})
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


def test_keyed_listener_serves_the_key_holder_only(keyed: int) -> None:
    assert fetch_payload("127.0.0.1", keyed, KEY) == PAYLOAD
    plain = fetch_payload("127.0.0.1", keyed, None)  # vLLM's own query, no key
    assert plain is not None and plain.agent_metadata_bytes == b""
    assert plain.compatibility_hash.startswith("kvstage-refused: this prefill requires the "
                                               "shared key")
    with pytest.raises(HandshakeRefused, match="refused the handshake: 'side-channel "
                       "message has a wrong MAC: the keys differ'"):
        fetch_payload("127.0.0.1", keyed, b"w" * 32)
    with pytest.raises(HandshakeRefused, match="no rank"):
        fetch_payload("127.0.0.1", keyed, KEY, tp_rank=3)
    assert remote_compat_hash("127.0.0.1", keyed, key=KEY) == PAYLOAD.compatibility_hash


def test_a_replayed_sealed_query_gets_nothing(keyed: int) -> None:
    auth = Authenticator(KEY)
    wire, nonce = auth.seal_bytes(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
    first = send_raw("127.0.0.1", keyed, wire, timeout_s=5)
    assert first is not None
    assert msgspec.msgpack.decode(auth.open_reply_bytes(first, nonce))[0] == \
        msgspec.msgpack.encode(PAYLOAD)
    again = send_raw("127.0.0.1", keyed, wire, timeout_s=5)
    assert again is not None
    refused = msgspec.msgpack.decode(again, type=NixlHandshakePayload)
    assert refused.agent_metadata_bytes == b""
    assert "replayed" in refused.compatibility_hash


def test_listener_survives_hostile_input(keyed: int) -> None:
    for junk in (b"", b"\xc1", msgspec.msgpack.encode([1, 2, 3, 4]), b"\x91" * 2000,
                 msgspec.msgpack.encode({"version": 3, "ts_ms": -1, "nonce": b"n" * 16,
                                         "payload": b""})):
        reply = send_raw("127.0.0.1", keyed, junk, timeout_s=5)
        assert reply is not None
        assert msgspec.msgpack.decode(reply, type=NixlHandshakePayload).agent_metadata_bytes \
            == b""
    # a message over the bound: zmq drops the connection, no answer, listener unharmed
    assert send_raw("127.0.0.1", keyed, b"x" * 8192, timeout_s=1) is None
    assert fetch_payload("127.0.0.1", keyed, KEY) == PAYLOAD


def test_unkeyed_listener_speaks_vllms_wire(unkeyed: int) -> None:
    assert fetch_payload("127.0.0.1", unkeyed, None) == PAYLOAD
    with pytest.raises(HandshakeRefused, match="this prefill has no shared key"):
        fetch_payload("127.0.0.1", unkeyed, KEY)
