"""`send_raw`: raw bytes to a side channel, the raw reply back, every wait bounded."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvstage.errors import InvalidRequest, ProtocolMismatch
from kvstage.pd import auth
from kvstage.pd import messages as m
from kvstage.pd.side_channel import SideChannelServer, send_raw

pytestmark = pytest.mark.timeout(60)


def test_send_raw_gets_the_reply_of_a_live_server() -> None:
    server = SideChannelServer()
    seen: list[m.Message | Exception] = []

    def answer() -> None:  # a sealed GetStats is answered Ok, junk is refused by its code
        for _ in range(2):
            got = server.poll(10.0)
            if got is None:
                return
            route, msg = got
            seen.append(msg)
            refusal = m.Error(message="refused", code=getattr(msg, "code", "error"))
            server.reply(route, refusal if isinstance(msg, Exception) else m.Ok())

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        wire, nonce = auth.Authenticator(None).seal(m.GetStats())
        raw = send_raw(server.host, server.port, wire, timeout_s=10.0)
        assert raw is not None
        assert isinstance(auth.Authenticator(None).open_reply(raw, nonce), m.Ok)
        raw = send_raw(server.host, server.port, b"\xc1 not msgpack", timeout_s=10.0)
        assert raw is not None
        err = auth.Authenticator(None).open_reply(raw, None)
        assert isinstance(err, m.Error) and err.code == "protocol_mismatch"
        thread.join(10)
        assert isinstance(seen[0], m.GetStats) and isinstance(seen[1], ProtocolMismatch)
    finally:
        thread.join(10)
        server.close()


def test_send_raw_returns_none_within_its_bound_when_nothing_answers() -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        start = time.monotonic()
        assert send_raw("127.0.0.1", port, b"anyone?", timeout_s=0.3) is None
        elapsed = time.monotonic() - start
    assert 0.25 <= elapsed < 3.0, elapsed  # waited its bound, and not much longer
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(InvalidRequest):
            send_raw("127.0.0.1", port, b"x", timeout_s=bad)
