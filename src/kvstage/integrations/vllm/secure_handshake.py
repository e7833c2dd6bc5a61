"""vLLM's NIXL handshake, sealed with kvstage's HMAC envelope (`kvstage.pd.auth`).

Contract
--------
Wire (one REQ/ROUTER exchange per (pp rank, tp rank), as vLLM's):
- keyed: the query ``msgpack((GET_META_MSG, pp_rank, tp_rank))`` travels as the payload of a
  sealed `auth.Envelope` (MAC, timestamp, nonce; replays refused); the reply is ONE frame, a
  sealed envelope answering that nonce whose payload is ``msgpack((payload bytes,
  perf_counter))``. A query that fails the check gets no metadata: a `refusal`.
- no key: vLLM's own wire (query as above, reply ``[payload, msgpack(perf_counter)]``).
- `refusal`: vLLM's two-frame reply whose `NixlHandshakePayload` has empty agent metadata
  and the compatibility hash ``REFUSED_PREFIX + reason``, so any vLLM client reports a hash
  mismatch that says why, and kvstage's raises `HandshakeRefused` with the reason.

Both ends run vLLM's own handshake code (`vllm_code.rebind`: a private copy of each
function with its ``zmq_ctx`` rebound, its source pinned by digest, nothing in vLLM modified)
on kvstage's own sockets, and only those:

- prefill: `serve_handshake` (the thread vLLM's scheduler starts, vLLM's arguments) runs
  vLLM's ``_nixl_handshake_listener`` on `_SealedRouter`, kvstage's side-channel ROUTER
  (`kvstage.pd.side_channel.SideChannelServer`, raw mode). It hands vLLM's loop only
  queries that passed `check_query` (key, replay, shape, a rank it serves), answers every
  other one itself with a `refusal`, and seals vLLM's reply; so the listener never dies on
  hostile input, bounds messages to `MAX_QUERY_BYTES`, and stops within 1 s of
  ``stop_event``.
- decode, with a key: `SealedHandshake` runs vLLM's ``_nixl_handshake`` (TP mapping, hash
  check, agent registration: all vLLM's) on `_SealedReq`, kvstage's REQ round trip
  (`SideChannelClient.exchange`) that seals the query and opens the reply. Without a key
  the worker runs vLLM's method as it is.

`fetch_payload` is the same exchange for one rank, bounded (diagnostics, tests).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.logger import init_logger

from kvstage.errors import HandshakeTimeout
from kvstage.integrations.vllm import vllm_code
from kvstage.pd.auth import Authenticator
from kvstage.pd.side_channel import SideChannelClient, SideChannelServer, send_raw

logger = init_logger(f"vllm.{__name__}")

REFUSED_PREFIX = "kvstage-refused: "
MAX_QUERY_BYTES = 1 << 12  # a sealed query is ~150 bytes
MAX_REASON_CHARS = 300


class HandshakeRefused(RuntimeError):
    """The handshake cannot be trusted: refused by the peer, or its reply failed the check."""


def _query(pp_rank: int, tp_rank: int) -> bytes:
    return msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))


def refusal(reason: str) -> list[bytes]:
    payload = NixlHandshakePayload(compatibility_hash=REFUSED_PREFIX + reason[:MAX_REASON_CHARS],
                                   agent_metadata_bytes=b"")
    return [msgspec.msgpack.encode(payload), msgspec.msgpack.encode(0.0)]


def _parse_query(data: bytes, encoded: dict[tuple[int, int], bytes]) -> bytes | str:
    """The payload a query asks for, or why it cannot be answered."""
    try:
        msg, pp_rank, tp_rank = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, TypeError, ValueError, RecursionError):
        return "not a vLLM NIXL handshake query"
    if msg != GET_META_MSG or not isinstance(pp_rank, int) or not isinstance(tp_rank, int):
        return "not a vLLM NIXL handshake query"
    payload = encoded.get((pp_rank, tp_rank))
    return f"no rank (pp {pp_rank}, tp {tp_rank}) here" if payload is None else payload


def check_query(data: bytes, encoded: dict[tuple[int, int], bytes],
                auth: Authenticator) -> tuple[bytes, bytes | None] | str:
    """(the plain query, the nonce its reply answers; None unkeyed) of a query vLLM's
    listener may be given, or why it is refused."""
    if auth.key is None:
        if Authenticator.peek_nonce(data):  # a keyed decode's sealed query
            return "this prefill has no shared key; the decode has one: give both the same key"
        inner, nonce = data, None
    elif not Authenticator.peek_nonce(data):
        return ("this prefill requires the shared key and the query carried none: give the "
                "decode the same key (KVSTAGE_KEY or kvstage_key_file)")
    else:
        try:
            inner, nonce = auth.open_request_bytes(data)
        except (ValueError, PermissionError) as e:  # Unauthorized, ProtocolMismatch
            return str(e)
    found = _parse_query(inner, encoded)
    return found if isinstance(found, str) else (inner, nonce)


def _host_port(addr: str) -> tuple[str, int]:
    """(host, port) of vLLM's ``tcp://host:port`` (``tcp://[v6]:port``) path."""
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


class _SealedRouter:
    """kvstage's ROUTER in the shape vLLM's listener uses (``setsockopt``, ``recv_multipart``
    raising ``zmq.Again`` after ``RCVTIMEO``, ``send_multipart``); see the module doc."""

    def __init__(self, addr: str, encoded: dict[tuple[int, int], bytes],
                 key: bytes | None) -> None:
        host, port = _host_port(addr)
        # the connector's Security.from_config refused an unkeyed public address at start,
        # worded for vLLM users: the server does not ask again
        self._server = SideChannelServer(host, port, key=key, insecure=True,
                                         max_message_bytes=MAX_QUERY_BYTES)
        self._auth = Authenticator(key)  # owned by the listener thread (its replay cache)
        self._encoded = encoded
        self._timeout_s = 1.0
        self._nonces: dict[bytes, bytes | None] = {}  # peer -> the query its reply answers
        self.num_refused = 0

    def setsockopt(self, option: int, value: Any) -> None:
        if option == zmq.RCVTIMEO and value > 0:
            self._timeout_s = value / 1000

    def recv_multipart(self) -> list[bytes]:
        deadline = time.monotonic() + self._timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = self._server.poll_raw(left)
            if got is None:
                break
            routing, data = got
            if len(routing) != 2 or routing[1] != b"":  # not a REQ socket: nothing to answer
                continue
            try:
                checked = check_query(data, self._encoded, self._auth)
            except Exception as e:  # hostile input must never stop the listener
                checked = f"unreadable query ({type(e).__name__})"
            if isinstance(checked, str):
                self._refuse(routing, checked)
                continue
            self._nonces[routing[0]] = checked[1]
            return [routing[0], b"", checked[0]]
        raise zmq.Again()

    def send_multipart(self, frames: Any) -> None:
        identity, _, payload, remote_perf = frames
        nonce = self._nonces.pop(bytes(identity), None)
        reply = [payload, remote_perf]
        if nonce is not None:
            body = msgspec.msgpack.encode((payload, msgspec.msgpack.decode(remote_perf)))
            reply = [self._auth.seal_bytes(body, reply_to=nonce)[0]]
        self._server.send_frames([identity, b""], reply)

    def _refuse(self, routing: list[bytes], reason: str) -> None:
        self.num_refused += 1
        if self.num_refused <= 10 or self.num_refused % 1000 == 0:
            logger.warning("kvstage: refused a NIXL handshake query (%d so far): %s",
                           self.num_refused, reason)
        self._server.send_frames(routing, refusal(reason))

    def close(self) -> None:
        self._server.close()


def serve_handshake(encoded: dict[tuple[int, int], bytes], ready_event: threading.Event,
                    stop_event: threading.Event, host: str, port: int, *,
                    key: bytes | None) -> None:
    """The prefill's handshake listener: vLLM's, on `_SealedRouter` (runs in vLLM's
    listener thread until stopped)."""

    @contextlib.contextmanager
    def router(socket_type: Any, addr: str) -> Iterator[_SealedRouter]:
        assert socket_type == zmq.ROUTER, "vLLM's listener opens a ROUTER socket only"
        sock = _SealedRouter(addr, encoded, key)
        try:
            yield sock
        finally:
            sock.close()

    try:
        listen = vllm_code.rebind(vllm_code.handshake_functions()[1], zmq_ctx=router)
        listen(encoded, ready_event, stop_event, host, port)
    finally:
        ready_event.set()  # a failed bind must not leave vLLM waiting forever


def open_reply(frame: bytes, auth: Authenticator, nonce: bytes,
               where: str) -> tuple[bytes, float]:
    """(handshake payload bytes, the peer's perf_counter) of a reply's first frame;
    `HandshakeRefused` with the reason otherwise."""
    try:
        inner = auth.open_reply_bytes(frame, nonce)
    except (ValueError, PermissionError) as e:
        try:
            plain = msgspec.msgpack.decode(frame, type=NixlHandshakePayload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise HandshakeRefused(
                f"the handshake reply from {where} failed the shared-key check: {e}") from None
        if plain.compatibility_hash.startswith(REFUSED_PREFIX):
            reason = plain.compatibility_hash[len(REFUSED_PREFIX):][:MAX_REASON_CHARS]
            raise HandshakeRefused(
                f"the prefill at {where} refused the handshake: {reason!r}") from None
        raise HandshakeRefused(
            f"the prefill at {where} answered without the shared key (it runs without one, "
            "or is not kvstage): give both instances the same key") from None
    try:
        payload, remote_perf = msgspec.msgpack.decode(inner)
        return bytes(payload), float(remote_perf)
    except (msgspec.DecodeError, TypeError, ValueError):
        raise HandshakeRefused(f"malformed sealed handshake reply from {where}") from None


class _SealedReq:
    """kvstage's REQ socket in the shape vLLM's ``_nixl_handshake`` uses (only the three
    methods that code calls): sends the query sealed, returns the opened reply as vLLM's
    two frames."""

    def __init__(self, addr: str, key: bytes) -> None:
        host, port = _host_port(addr)
        self._client = SideChannelClient(host, port)
        self._auth = Authenticator(key)
        self._where = f"{host}:{port}"
        self._timeout_s: float | None = None
        self._wire, self._nonce = b"", b""

    def setsockopt(self, option: int, value: Any) -> None:
        if option == zmq.RCVTIMEO and value > 0:  # vLLM bounds the reply wait (ms)
            self._timeout_s = value / 1000

    def send(self, data: bytes) -> None:
        self._wire, self._nonce = self._auth.seal_bytes(bytes(data))

    def recv_multipart(self) -> list[bytes]:
        try:
            frame = self._client.exchange(self._wire, timeout_s=self._timeout_s)
        except HandshakeTimeout:
            raise HandshakeTimeout(
                f"no handshake answer from the prefill at {self._where} within "
                f"{self._timeout_s or self._client.timeout_s:g} s: is the prefill instance "
                "up, and its VLLM_NIXL_SIDE_CHANNEL_HOST/PORT reachable from here?") from None
        payload, remote_perf = open_reply(frame, self._auth, self._nonce, self._where)
        return [payload, msgspec.msgpack.encode(remote_perf)]


class SealedHandshake:
    """vLLM's ``_nixl_handshake`` on `_SealedReq`; call it as the method:
    ``sealed(worker, host, port, ...)``."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._run: Callable[..., tuple[dict[tuple[int, int], str], float]] = vllm_code.rebind(
            vllm_code.handshake_functions()[0], zmq_ctx=self._socket)

    @classmethod
    def for_key(cls, key: bytes | None) -> SealedHandshake | None:
        """Check both rebound vLLM functions now (`vllm_code.check_vllm`: the listener
        runs on kvstage's socket with or without a key); the sealed query for ``key``,
        None without one."""
        vllm_code.check_vllm()
        return None if key is None else cls(key)

    @contextlib.contextmanager
    def _socket(self, socket_type: Any, addr: str) -> Iterator[_SealedReq]:
        assert socket_type == zmq.REQ, "vLLM's handshake opens a REQ socket only"
        yield _SealedReq(addr, self._key)

    def __call__(self, worker: Any, *args: Any,
                 **kwargs: Any) -> tuple[dict[tuple[int, int], str], float]:
        return self._run(worker, *args, **kwargs)


def fetch_payload(host: str, port: int, key: bytes | None, *, pp_rank: int = 0,
                  tp_rank: int = 0, timeout_s: float = 5.0) -> NixlHandshakePayload | None:
    """One rank's handshake payload from the listener at ``host:port`` (sealed when
    ``key``); None when nothing answers within ``timeout_s`` or the answer is not a
    payload; `HandshakeRefused` when a keyed exchange fails its check."""
    where = f"{host}:{port}"
    if key is None:
        reply = send_raw(host, port, _query(pp_rank, tp_rank), timeout_s=timeout_s)
    else:
        auth = Authenticator(key)
        wire, nonce = auth.seal_bytes(_query(pp_rank, tp_rank))
        reply = send_raw(host, port, wire, timeout_s=timeout_s)
        if reply is not None:
            reply, _ = open_reply(reply, auth, nonce, where)
    if reply is None:
        return None
    try:
        return msgspec.msgpack.decode(reply, type=NixlHandshakePayload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
