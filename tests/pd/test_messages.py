"""Side-channel messages: versions, garbled and foreign payloads."""

from __future__ import annotations

import msgspec
import pytest

from kvstage.pd import messages as m

pytestmark = pytest.mark.timeout(60)


def test_message_from_another_version() -> None:
    data = msgspec.msgpack.encode({"type": "get_meta", "version": 99, "engine_id": "x"})
    with pytest.raises(ValueError) as err:
        m.decode(data)
    msg = str(err.value)
    assert f"protocol version 99, this kvstage speaks {m.PROTOCOL_VERSION}" in msg
    assert "run the same kvstage version on prefill and decode" in msg
    no_version = msgspec.msgpack.encode({"type": "get_meta", "engine_id": "x"})
    with pytest.raises(ValueError, match="protocol version None"):
        m.decode(no_version)


GOOD = m.encode(m.PrefillRequest(request_id="r", num_tokens=10, seed=1))
GARBLED = {
    "truncated": GOOD[: len(GOOD) // 2],
    "empty": b"",
    "random": bytes(range(200, 256)) * 2,
    "not-a-map": msgspec.msgpack.encode([1, 2, 3]),
    "unknown-type": msgspec.msgpack.encode({"type": "launch", "version": m.PROTOCOL_VERSION}),
    "wrong-field-type": msgspec.msgpack.encode(
        {"type": "prefill", "version": m.PROTOCOL_VERSION, "request_id": "r",
         "num_tokens": "ten", "seed": 1}
    ),
    "missing-field": msgspec.msgpack.encode(
        {"type": "prefill", "version": m.PROTOCOL_VERSION, "seed": 1}),
}


@pytest.mark.parametrize("name", sorted(GARBLED))
def test_truncated_or_garbled_message(name: str) -> None:
    with pytest.raises(ValueError) as err:
        m.decode(GARBLED[name])
    msg = str(err.value)
    assert ("is not a kvstage message" in msg) or ("malformed side-channel message" in msg)
    assert m.decode(GOOD) == m.PrefillRequest(request_id="r", num_tokens=10, seed=1)


