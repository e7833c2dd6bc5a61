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
arguments as vLLM's ``_nixl_handshake_listener``) over kvstage's own side-channel socket
(`kvstage.pd.side_channel.SideChannelServer`, raw mode): it never dies on hostile input,
bounds messages to `MAX_QUERY_BYTES`, and stops within 1 s of ``stop_event``.

Decode side, with a key: `SealedHandshake` runs vLLM's own ``_nixl_handshake`` code (TP
mapping, hash check, agent registration: all vLLM's) with ONE name rebound in a private copy
of its globals: ``zmq_ctx`` opens kvstage's REQ socket (`SideChannelClient.exchange`) that
seals the query and opens the reply. Nothing in vLLM is modified, no other socket is
touched; at start it refuses, in one line, a vLLM whose ``_nixl_handshake`` source is not
the one recorded (`HANDSHAKE_SHA256`), as that code is what it relies on (it opens one
``zmq_ctx(zmq.REQ, path)`` and calls ``setsockopt``, ``send``, ``recv_multipart`` on it).
Without a key the worker runs vLLM's method as it is. `fetch_payload` is the same exchange
for one rank, bounded (diagnostics, tests).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import inspect
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlHandshakePayload
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.logger import init_logger

from kvstage.pd.auth import Authenticator
from kvstage.pd.side_channel import SideChannelClient, SideChannelServer, send_raw

logger = init_logger(f"vllm.{__name__}")

REFUSED_PREFIX = "kvstage-refused: "
MAX_QUERY_BYTES = 1 << 12  # a sealed query is ~150 bytes
MAX_REASON_CHARS = 300
#: `source_sha256` of ``NixlBaseConnectorWorker._nixl_handshake``, the vLLM code
#: `SealedHandshake` runs with kvstage's socket (the same source in these versions)
HANDSHAKE_SHA256 = "cb2c6a99930e8e968917e9ef1cda7cabe42c0a2ed6704cf9b890c71715d58830"
HANDSHAKE_VERSIONS = ("0.32.0", "0.33.0")


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
    try:
        # the connector's Security.from_config refused an unkeyed public address at start,
        # worded for vLLM users: the server does not ask again
        server = SideChannelServer(host, port, key=key, insecure=True,
                                   max_message_bytes=MAX_QUERY_BYTES)
    finally:
        ready_event.set()  # a failed bind must not leave vLLM waiting forever
    auth = Authenticator(key)  # owned by this thread (its replay cache)
    num_refused = 0
    try:
        while not stop_event.is_set():
            got = server.poll_raw(1.0)
            if got is None:
                continue
            routing, query = got
            if len(routing) != 2 or routing[1] != b"":  # not a REQ socket: nothing to answer
                continue
            try:
                reply, reason = answer(query, encoded, auth)
            except Exception as e:  # hostile input must never stop the listener
                reply, reason = refusal(f"unreadable query ({type(e).__name__})"), "unreadable"
            if reason is not None:
                num_refused += 1
                if num_refused <= 10 or num_refused % 1000 == 0:
                    logger.warning("kvstage: refused a NIXL handshake query (%d so far): %s",
                                   num_refused, reason)
            server.send_frames(routing, reply)
    finally:
        server.close()


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
        host, _, port = addr.removeprefix("tcp://").rpartition(":")
        self._client = SideChannelClient(host.strip("[]"), int(port))
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
        frame = self._client.exchange(self._wire, timeout_s=self._timeout_s)
        payload, remote_perf = open_reply(frame, self._auth, self._nonce, self._where)
        return [payload, msgspec.msgpack.encode(remote_perf)]


def source_sha256(module_source: str, qualname: str) -> str:
    """sha256 of the source lines of ``Class.method`` in ``module_source`` (found by ast, so
    the same digest comes from an installed vLLM and from a wheel's file)."""
    cls_name, name = qualname.split(".")
    tree = ast.parse(module_source)
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == cls_name:
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    assert node.end_lineno is not None
                    lines = module_source.splitlines()[node.lineno - 1:node.end_lineno]
                    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
    raise LookupError(f"no {qualname} in that source")


class SealedHandshake:
    """vLLM's ``_nixl_handshake`` with its ``zmq_ctx`` bound to kvstage's sealed socket;
    call it as the method: ``sealed(worker, host, port, ...)``."""

    def __init__(self, key: bytes) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorWorker

        func = NixlConnectorWorker._nixl_handshake
        check_recorded(func)
        scope = dict(func.__globals__)
        scope["zmq_ctx"] = self._socket
        run = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__,
                                 func.__closure__)
        run.__kwdefaults__ = func.__kwdefaults__
        self._run: Callable[..., tuple[dict[tuple[int, int], str], float]] = run
        self._key = key

    @classmethod
    def for_key(cls, key: bytes | None) -> SealedHandshake | None:
        """The sealed handshake for ``key`` (checked against vLLM now); None without one."""
        return None if key is None else cls(key)

    @contextlib.contextmanager
    def _socket(self, socket_type: Any, addr: str) -> Iterator[_SealedReq]:
        assert socket_type == zmq.REQ, "vLLM's handshake opens a REQ socket only"
        yield _SealedReq(addr, self._key)

    def __call__(self, worker: Any, *args: Any,
                 **kwargs: Any) -> tuple[dict[tuple[int, int], str], float]:
        return self._run(worker, *args, **kwargs)


def check_recorded(func: Any) -> None:
    """Refuse (RuntimeError, one line) a vLLM whose ``func`` is not the recorded code."""
    import vllm

    module = sys.modules[func.__module__]
    digest = source_sha256(inspect.getsource(module), func.__qualname__)
    if digest != HANDSHAKE_SHA256:
        raise RuntimeError(
            f"kvstage cannot seal vLLM {vllm.__version__}'s NIXL handshake: "
            f"{func.__qualname__} ({func.__module__}) is not the code kvstage recorded "
            f"(source sha256 {digest[:16]}, recorded {HANDSHAKE_SHA256[:16]}, vLLM "
            f"{', '.join(HANDSHAKE_VERSIONS)}); run a supported vLLM, or run without a key"
        )


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
