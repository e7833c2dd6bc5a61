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

`serve_handshake` is the prefill-side listener (the thread vLLM's scheduler starts, same
arguments as vLLM's ``_nixl_handshake_listener``): it never dies on hostile input, bounds
messages to `MAX_QUERY_BYTES`, and stops within 1 s of ``stop_event``.

Decode side: `install` wraps the ``zmq_ctx`` that vLLM's ``_nixl_handshake`` opens its REQ
socket with; inside `sealed_handshakes(key)` (a thread-local switch, set by
`KVStageConnectorWorker._nixl_handshake` around vLLM's method in vLLM's handshake thread)
that socket seals the query and opens the reply, so vLLM's own handshake code runs
unchanged on the verified bytes. Elsewhere, and without a key, it is vLLM's socket.
`fetch_payload` is the same exchange for one rank, bounded (diagnostics, tests).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.logger import init_logger
from vllm.utils.network_utils import make_zmq_path

from kvstage.pd.auth import Authenticator
from kvstage.pd.side_channel import send_raw

logger = init_logger(f"vllm.{__name__}")

REFUSED_PREFIX = "kvstage-refused: "
MAX_QUERY_BYTES = 1 << 12  # a sealed query is ~150 bytes
MAX_REASON_CHARS = 300
_local = threading.local()


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


def answer(data: bytes, encoded: dict[tuple[int, int], bytes],
           auth: Authenticator) -> tuple[list[bytes], str | None]:
    """The reply frames to one query, and the reason when it is a refusal."""
    if auth.key is None:
        if Authenticator.peek_nonce(data):  # a keyed decode's sealed query
            reason = ("this prefill has no shared key; the decode has one: give both the "
                      "same key")
            return refusal(reason), reason
        found = _parse_query(data, encoded)
        if isinstance(found, str):
            return refusal(found), found
        return [found, msgspec.msgpack.encode(time.perf_counter())], None
    if not Authenticator.peek_nonce(data):
        reason = ("this prefill requires the shared key and the query carried none: give "
                  "the decode the same key (KVSTAGE_KEY or kvstage_key_file)")
        return refusal(reason), reason
    try:
        inner, nonce = auth.open_request_bytes(data)
    except (ValueError, PermissionError) as e:  # Unauthorized, ProtocolMismatch
        return refusal(str(e)), str(e)
    found = _parse_query(inner, encoded)
    if isinstance(found, str):
        return refusal(found), found
    sealed, _ = auth.seal_bytes(msgspec.msgpack.encode((found, time.perf_counter())),
                                reply_to=nonce)
    return [sealed], None


def serve_handshake(encoded: dict[tuple[int, int], bytes], ready_event: threading.Event,
                    stop_event: threading.Event, host: str, port: int, *,
                    key: bytes | None) -> None:
    """The prefill's handshake listener (runs in vLLM's listener thread until stopped)."""
    auth = Authenticator(key)  # owned by this thread (its replay cache)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    num_refused = 0
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_QUERY_BYTES)
        path = make_zmq_path("tcp", host, port)
        if path.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(path)
        ready_event.set()
        while not stop_event.is_set():
            if not sock.poll(1000, zmq.POLLIN):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":  # not a REQ socket: nothing to answer
                continue
            try:
                reply, reason = answer(frames[2], encoded, auth)
            except Exception as e:  # hostile input must never stop the listener
                reply, reason = refusal(f"unreadable query ({type(e).__name__})"), "unreadable"
            if reason is not None:
                num_refused += 1
                if num_refused <= 10 or num_refused % 1000 == 0:
                    logger.warning("kvstage: refused a NIXL handshake query (%d so far): %s",
                                   num_refused, reason)
            sock.send_multipart([frames[0], b"", *reply])
    finally:
        ready_event.set()  # a failed bind must not leave vLLM waiting forever
        sock.close(linger=0)
        ctx.term()


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
    """The REQ socket vLLM's ``_nixl_handshake`` uses, sealing what it sends and opening
    what it receives (only the three methods that code calls)."""

    def __init__(self, sock: Any, key: bytes, where: str) -> None:
        self._sock = sock
        self._auth = Authenticator(key)
        self._where = where
        self._nonce = b""

    def setsockopt(self, option: int, value: Any) -> None:
        self._sock.setsockopt(option, value)

    def send(self, data: bytes) -> None:
        wire, self._nonce = self._auth.seal_bytes(bytes(data))
        self._sock.send(wire)

    def recv_multipart(self) -> list[bytes]:
        frames = self._sock.recv_multipart()
        payload, remote_perf = open_reply(frames[0], self._auth, self._nonce, self._where)
        return [payload, msgspec.msgpack.encode(remote_perf)]


@contextlib.contextmanager
def sealed_handshakes(key: bytes | None) -> Iterator[None]:
    """Inside, on this thread, vLLM's handshake sockets are sealed with ``key`` (None:
    vLLM's own)."""
    before = getattr(_local, "key", None)
    _local.key = key
    try:
        yield
    finally:
        _local.key = before


def install() -> None:
    """Wrap vLLM's ``base_worker.zmq_ctx`` once per process (see the module doc)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    original = base_worker.zmq_ctx
    if getattr(original, "kvstage_sealed", False):
        return

    @contextlib.contextmanager
    def zmq_ctx(socket_type: Any, addr: str) -> Iterator[Any]:
        key = getattr(_local, "key", None)
        with original(socket_type, addr) as sock:
            yield sock if key is None or socket_type != zmq.REQ else _SealedReq(sock, key, addr)

    zmq_ctx.kvstage_sealed = True  # type: ignore[attr-defined]
    base_worker.zmq_ctx = zmq_ctx


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
