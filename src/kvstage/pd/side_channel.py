"""The side channel: a zmq ROUTER on the prefill side, a REQ per call on the decode side.

Binds 127.0.0.1 by default; every wait is bounded, and so is every message
(`messages.MAX_MESSAGE_BYTES`: zmq drops the connection of a peer that sends more). A
request that gets no reply within its timeout raises `HandshakeTimeout` (the REQ socket
is discarded, so a late reply can never be read as the answer to a later question). An
``Error`` reply raises `PeerError` carrying the peer's error code.

Authentication (`kvstage.pd.auth`): with ``key``, every request and reply is sealed
(HMAC-SHA256, timestamp, nonce) and checked; the server hands a refused request to its
owner as an `Unauthorized` error (the owner replies ``Error(code="unauthorized")``), a
client raises `Unauthorized` for a reply it cannot verify. ``SideChannelServer`` refuses a
non-loopback address without a key unless ``insecure``.

`send_raw` sends bytes a `SideChannelClient` would never produce (tests, benches, fuzzing)
and returns the raw reply, or None when none comes within its bound.

The server's `poll_raw`/`send_frames` hand a caller unopened payloads and take its reply
frames; the client's `exchange` is one bounded REQ round trip of bytes the caller sealed
(`send_raw` and the fuzz tests use them).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import zmq

from kvstage.errors import HandshakeTimeout, InvalidRequest, PeerError, ProtocolMismatch
from kvstage.pd.auth import Authenticator, check_bind
from kvstage.pd.messages import MAX_MESSAGE_BYTES, Error, Message

DEFAULT_HOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 5.0


__all__ = ["HandshakeTimeout", "PeerError", "SideChannelClient", "SideChannelServer",
           "send_raw"]


def parse_address(address: str, *, default_host: str = DEFAULT_HOST) -> tuple[str, int]:
    """``HOST:PORT`` (or ``:PORT``) -> (host, port), with a clear error otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise InvalidRequest(
            f"expected HOST:PORT with a port 0-65535 (e.g. 127.0.0.1:5600), got {address!r}"
        )
    if ":" in host or host.startswith("["):
        raise InvalidRequest(
            f"IPv6 addresses are not supported yet (got {address!r}); use an IPv4 address "
            "or a host name that resolves to one"
        )
    if not host.isascii() or any(c.isspace() for c in host):
        raise InvalidRequest(f"host {host!r} in {address!r} is not a valid host name or IPv4")
    return (host or default_host), int(port)


class SideChannelClient:
    """Ask a prefill worker's side channel one question at a time."""

    def __init__(self, host: str, port: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 key: bytes | None = None) -> None:
        if not 0 < timeout_s < float("inf"):
            raise InvalidRequest(f"timeout_s must be a finite number > 0, got {timeout_s}")
        self.endpoint = f"tcp://[{host.strip('[]')}]:{port}" if ":" in host else \
            f"tcp://{host}:{port}"
        self.timeout_s = timeout_s
        self._auth = Authenticator(key)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()

    def exchange(self, wire: bytes, *, timeout_s: float | None = None) -> bytes:
        """Send ``wire`` (already sealed, or plain) on a fresh REQ socket and return the
        reply's bytes; `HandshakeTimeout` when none comes within the bound."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        reply = _request(self._ctx, self.endpoint, wire, timeout_s=timeout,
                         max_reply_bytes=MAX_MESSAGE_BYTES)
        if reply is None:
            raise HandshakeTimeout(
                f"no answer from {self.endpoint} within {timeout:.1f} s: is a kvstage "
                "prefill worker listening there (kvstage prefill --listen HOST:PORT), "
                "and is the address reachable?"
            )
        return reply

    def call(self, msg: Message, *, timeout_s: float | None = None) -> Message:
        wire, nonce = self._auth.seal(msg)
        reply = self._auth.open_reply(self.exchange(wire, timeout_s=timeout_s), nonce)
        if isinstance(reply, Error):
            raise PeerError(
                f"{self.endpoint} refused {type(msg).__name__}: {reply.message}", reply.code
            )
        return reply


def send_raw(host: str, port: int, payload: bytes, *, timeout_s: float) -> bytes | None:
    """Send ``payload`` as is on a fresh REQ socket to ``tcp://host:port``; return the raw
    reply, or None if none arrives within ``timeout_s`` (sending included).

    For tests, benches and fuzzing that must send bytes a `SideChannelClient` would never
    produce (garbage, replays, messages sealed with another key). Nothing is sealed,
    checked or decoded; the socket is always closed (LINGER 0), so a late reply is lost.
    """
    return _request(zmq.Context.instance(), f"tcp://{host}:{port}", payload,
                    timeout_s=timeout_s)


def _request(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, payload: bytes, *,
             timeout_s: float, max_reply_bytes: int | None = None) -> bytes | None:
    """The one REQ round trip: a fresh socket (LINGER 0, so a late reply is lost), the
    reply's bytes or None when none arrives within ``timeout_s`` (sending included)."""
    if not 0 < timeout_s < float("inf"):
        raise InvalidRequest(f"timeout_s must be a finite number > 0, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, max(1, math.ceil(timeout_s * 1000)))
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if max_reply_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
    try:
        sock.connect(endpoint)
        try:
            sock.send(payload)
        except zmq.Again:  # could not even queue it within the bound
            return None
        left_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
        if not sock.poll(left_ms, zmq.POLLIN):
            return None
        return sock.recv()
    finally:
        sock.close(linger=0)


@dataclass(frozen=True)
class Route:
    """Where a reply goes: the zmq routing frames and the request's nonce."""

    frames: list[bytes]
    nonce: bytes


class SideChannelServer:
    """A non-blocking ROUTER: `poll` returns at most one (route, message or error)."""

    def __init__(self, host: str = DEFAULT_HOST, port: int = 0, *, key: bytes | None = None,
                 insecure: bool = False, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        check_bind(host, key, insecure=insecure)
        self._auth = Authenticator(key)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        where = host
        if ":" in host:  # an IPv6 literal (vLLM's side-channel host may be one)
            self._sock.setsockopt(zmq.IPV6, 1)
            where = f"[{host.strip('[]')}]"
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{where}")
            else:
                self._sock.bind(f"tcp://{where}:{port}")
                self.port = port
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise OSError(f"cannot listen on {host}:{port}: {exc}") from None
        self.host = host

    def poll(self, timeout_s: float) -> tuple[Route, Message | Exception] | None:
        """One request: its route and the message, or the error (`Unauthorized`,
        `ProtocolMismatch`) that refused it."""
        got = self.poll_raw(timeout_s)
        if got is None:
            return None
        routing, payload = got
        try:
            msg, nonce = self._auth.open_request(payload)
        except (ValueError, PermissionError) as exc:
            return Route(routing, self._auth.peek_nonce(payload)), exc
        except Exception as exc:  # hostile input must never stop the server: refuse it
            return Route(routing, self._auth.peek_nonce(payload)), ProtocolMismatch(
                f"unreadable side-channel message ({type(exc).__name__})"
            )
        return Route(routing, nonce), msg

    def poll_raw(self, timeout_s: float) -> tuple[list[bytes], bytes] | None:
        """One request as it arrived: its routing frames and its last frame, unopened."""
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        frames = self._sock.recv_multipart()
        return frames[:-1], frames[-1]

    def readable(self, timeout_s: float) -> bool:
        """True once a request waits (up to ``timeout_s``); nothing is received."""
        return bool(self._sock.poll(int(timeout_s * 1000), zmq.POLLIN))

    def reply(self, route: Route, msg: Message) -> None:
        wire, _ = self._auth.seal(msg, reply_to=route.nonce)
        self.send_frames(route.frames, [wire])

    def send_frames(self, routing: list[bytes], frames: list[bytes]) -> None:
        """Reply with ``frames`` as they are (the caller sealed what needs sealing)."""
        self._sock.send_multipart([*routing, *frames])

    def close(self) -> None:
        self._sock.close(linger=0)
