"""Side-channel authentication and per-request capabilities.

Contract:
- Every side-channel message, both ways, travels in an `Envelope` (version, timestamp,
  nonce, reply_to, mac, payload = `messages.encode(msg)`). With a shared key, ``mac`` is
  HMAC-SHA256 over the direction, timestamp, nonce, reply_to and payload; a receiver
  refuses (`Unauthorized`) a missing or wrong MAC, a timestamp more than `MAX_SKEW_S`
  from its own clock, a request nonce it has seen in that window (replay), and a reply
  whose ``reply_to`` is not the nonce of the request it sent. The payload of a request is
  parsed only after its MAC verified. Without a key (the zero-config loopback default)
  envelopes carry no MAC and nothing is checked: any local process may speak.
- The replay cache is bounded (`MAX_NONCES` request nonces, each kept 2 x `MAX_SKEW_S`
  after receipt); when it is full a request is refused, never forgotten.
- The key comes from a file (``--key-file``) or the environment (`KEY_ENV`), never from
  a flag value (`load_key`); it is at least `MIN_KEY_BYTES` bytes.
- A prefill binding a non-loopback address without a key is refused unless the caller
  says ``insecure`` (`check_bind`).
- Capabilities, two modes of one token (`TOKEN_BYTES`): ISSUED, `new_capability()`, random
  and stored with the held request (the CLI's prefill role, which holds its requests);
  DERIVED, `derived_capability(key, scope, request_id)`, an HMAC-SHA256 of the request id
  under the shared key, so whoever hands it out and whoever checks it need no shared state
  (vLLM's scheduler hands it out, its worker process checks it: `KVStageConnector`). The
  decode's notification is `completion_notif(request_id, capability)` either way, parsed
  with `parse_notif`; tokens are compared with `same_capability` (constant time).

Thread rules: an `Authenticator` is used by one thread (its replay cache is not locked).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

import msgspec

from kvstage.errors import InvalidRequest, ProtocolMismatch, Unauthorized
from kvstage.pd import messages as m

KEY_ENV = "KVSTAGE_KEY"
MIN_KEY_BYTES = 16
MAX_SKEW_S = 30.0  # a timestamp further than this from the receiver's clock is refused
MAX_NONCES = 65536  # ~1000 requests/s sustained over the 60 s replay window
NONCE_BYTES = 16
TOKEN_BYTES = 16
_DOMAIN = b"kvstage-side-channel\x00"
_CAPABILITY_DOMAIN = b"kvstage-vllm-capability\x00"  # the derived mode's (wire: unchanged)
_NOTIF_SEP = b"#"
_NOTIF_TAIL = 1 + 2 * TOKEN_BYTES  # "#" + hex token


class Envelope(msgspec.Struct, kw_only=True):
    """What travels on the socket. ``version`` first, so a peer of another protocol
    version is told which one it speaks before anything else is trusted."""

    version: int = m.PROTOCOL_VERSION
    ts_ms: int  # sender's wall clock (ms since the epoch)
    nonce: bytes  # NONCE_BYTES random bytes
    reply_to: bytes = b""  # a reply: the nonce of the request it answers
    mac: bytes = b""  # HMAC-SHA256, or empty without a key
    payload: bytes


_env_decoder = msgspec.msgpack.Decoder(Envelope)
_env_encoder = msgspec.msgpack.Encoder()


def _mac(key: bytes, direction: bytes, env: Envelope) -> bytes:
    head = struct.pack(">cqB", direction, env.ts_ms, len(env.nonce))
    body = b"".join((_DOMAIN, head, env.nonce, struct.pack(">B", len(env.reply_to)),
                     env.reply_to, env.payload))
    return hmac.new(key, body, hashlib.sha256).digest()


class Authenticator:
    """Seals outgoing messages and opens incoming ones for one side of the channel.

    ``key`` None: no MAC, no checks. ``clock`` is wall-clock seconds (``time.time``)."""

    def __init__(self, key: bytes | None, *, max_skew_s: float = MAX_SKEW_S,
                 max_nonces: int = MAX_NONCES, clock: Callable[[], float] = time.time) -> None:
        if key is not None:
            check_key(key)
        self.key = key
        self.max_skew_ms = int(max_skew_s * 1000)
        self.max_nonces = max_nonces
        self.clock = clock
        self._nonces: OrderedDict[bytes, float] = OrderedDict()  # nonce -> receipt time

    @property
    def num_nonces(self) -> int:
        return len(self._nonces)

    def seal(self, msg: m.Message, *, reply_to: bytes | None = None) -> tuple[bytes, bytes]:
        """(wire bytes, nonce) of ``msg``; a reply passes its request's nonce (b"" when
        the request had none), so a reply can never pass for a request."""
        return self.seal_bytes(m.encode(msg), reply_to=reply_to)

    def seal_bytes(self, payload: bytes, *,
                   reply_to: bytes | None = None) -> tuple[bytes, bytes]:
        """`seal` for a payload that is not a kvstage message (vLLM's handshake, carried
        by `kvstage.integrations.vllm.secure`); the caller decodes it after opening."""
        env = Envelope(ts_ms=int(self.clock() * 1000), nonce=secrets.token_bytes(NONCE_BYTES),
                       reply_to=reply_to or b"", payload=payload)
        if self.key is not None:
            env.mac = _mac(self.key, b"Q" if reply_to is None else b"P", env)
        return _env_encoder.encode(env), env.nonce

    @staticmethod
    def peek_nonce(data: bytes) -> bytes:
        """The nonce a request claims (unverified; b"" if unreadable), so a refusal can
        still answer it."""
        try:
            nonce = _env_decoder.decode(data).nonce
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return b""
        return nonce[:NONCE_BYTES]

    def open_request(self, data: bytes) -> tuple[m.Message, bytes]:
        """(message, its nonce) of a request; `Unauthorized` or `ProtocolMismatch`."""
        payload, nonce = self.open_request_bytes(data)
        return m.decode(payload), nonce

    def open_request_bytes(self, data: bytes) -> tuple[bytes, bytes]:
        """`open_request` without decoding the payload (only after its MAC verified)."""
        env = self._envelope(data)
        if self.key is not None:
            self._verify(env, b"Q")
            self._remember(env.nonce)
        return env.payload, env.nonce

    def open_reply(self, data: bytes, request_nonce: bytes | None) -> m.Message:
        """The reply to the request sent with ``request_nonce`` (None: not checked, for
        tests that send raw bytes)."""
        return m.decode(self.open_reply_bytes(data, request_nonce))

    def open_reply_bytes(self, data: bytes, request_nonce: bytes | None) -> bytes:
        """`open_reply` without decoding the payload."""
        env = self._envelope(data)
        if self.key is not None:
            self._verify(env, b"P")
            if request_nonce is not None and not hmac.compare_digest(env.reply_to,
                                                                     request_nonce):
                raise Unauthorized("side-channel reply does not answer this request")
        return env.payload

    def _envelope(self, data: bytes) -> Envelope:
        if len(data) > m.MAX_MESSAGE_BYTES:
            raise ProtocolMismatch(
                f"side-channel message of {len(data)} bytes; at most {m.MAX_MESSAGE_BYTES}"
            )
        try:
            env = _env_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            m.decode(data)  # names a foreign protocol version if that is what arrived
            raise ProtocolMismatch(
                f"side-channel message is not a kvstage message envelope ({len(data)} bytes, "
                f"starts {data[:16]!r}): {str(exc)[:120]}"
            ) from None
        if env.version != m.PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"peer speaks side-channel protocol version {env.version!r}, this kvstage "
                f"speaks {m.PROTOCOL_VERSION}: run the same kvstage version on both sides"
            )
        # bounds the MAC's fixed-width header needs (a hostile uint64 timestamp or a long
        # nonce must be refused here, never crash the packing)
        if not 0 <= env.ts_ms < 1 << 63 or len(env.nonce) > 255 or len(env.reply_to) > 255:
            raise ProtocolMismatch(
                "side-channel envelope out of range: timestamp must be a non-negative "
                "int64 and nonce / reply_to at most 255 bytes"
            )
        return env

    def _verify(self, env: Envelope, direction: bytes) -> None:
        assert self.key is not None
        if not env.mac:
            raise Unauthorized(
                "side-channel message carries no MAC: this peer requires the shared key "
                f"(--key-file PATH or {KEY_ENV}) on both sides"
            )
        if len(env.nonce) != NONCE_BYTES or not hmac.compare_digest(
            env.mac, _mac(self.key, direction, env)
        ):
            raise Unauthorized("side-channel message has a wrong MAC: the keys differ")
        skew = env.ts_ms - int(self.clock() * 1000)
        if abs(skew) > self.max_skew_ms:
            raise Unauthorized(
                f"side-channel message timestamp is {skew / 1000:+.0f} s from this clock "
                f"(at most {self.max_skew_ms / 1000:.0f} s): stale, replayed, or the clocks "
                "differ (run NTP)"
            )

    def _remember(self, nonce: bytes) -> None:
        now = self.clock()
        horizon = now - 2 * self.max_skew_ms / 1000
        while self._nonces:
            oldest, seen = next(iter(self._nonces.items()))
            if seen > horizon:
                break
            del self._nonces[oldest]
        # a time window on the sender's clock; receipt order is the eviction order
        if nonce in self._nonces:
            raise Unauthorized("side-channel message replayed (nonce already seen)")
        if len(self._nonces) >= self.max_nonces:
            raise Unauthorized(
                f"replay cache full ({self.max_nonces} messages within "
                f"{2 * self.max_skew_ms / 1000:.0f} s): refused rather than forgotten"
            )
        self._nonces[nonce] = now


# -- keys and binding -----------------------------------------------------------------------
def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        raise InvalidRequest(
            f"the shared key must be at least {MIN_KEY_BYTES} bytes (e.g. `head -c 32 "
            "/dev/urandom | base64 > key`), got "
            f"{len(key) if isinstance(key, bytes) else type(key).__name__}"
        )
    return key


def load_key(path: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared key from ``path`` (wins) or `KEY_ENV`; None if neither is given.

    The file must be a regular file readable by its owner only (like ssh's keys: mode
    0600 or 0400); surrounding whitespace (a trailing newline) is stripped."""
    env = os.environ if environ is None else environ
    if path is not None:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"key file {path!r} is not a regular file")
            if st.st_mode & 0o077:
                raise InvalidRequest(
                    f"key file {path!r} is readable by group or others (mode "
                    f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`"
                )
            with open(path, "rb") as f:
                key = f.read(1 << 16).strip()
        except OSError as exc:
            raise InvalidRequest(f"cannot read key file {path!r}: {exc.strerror}") from None
        if not key:
            raise InvalidRequest(f"key file {path!r} is empty")
        return check_key(key)
    text = env.get(KEY_ENV)
    if text is None:
        return None
    key = text.strip().encode()
    if not key:
        raise InvalidRequest(f"{KEY_ENV} is set but empty")
    return check_key(key)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_bind(host: str, key: bytes | None, *, insecure: bool,
               action: str = "listen on",
               fix: str = f"(--key-file PATH or {KEY_ENV}) on prefill and decode, or pass "
                          "--insecure") -> None:
    """Refuse to serve (or ``action``) a non-loopback address without a key unless
    ``insecure``; ``fix`` names the settings (the CLI's flags by default)."""
    if key is None and not insecure and not is_loopback(host):
        raise InvalidRequest(
            f"refusing to {action} {host} without a key: anyone who reaches the port "
            f"could release requests and READ the host buffer. Give a shared key {fix}"
        )


# -- capabilities ---------------------------------------------------------------------------
def new_capability() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def derived_capability(key: bytes, scope: str, request_id: str) -> bytes:
    """The request's capability under ``key`` within ``scope`` (e.g. the prefill's engine
    id), derived, never stored: ``HMAC-SHA256(key, domain, scope, request id)[:16]``."""
    body = b"".join((_CAPABILITY_DOMAIN, scope.encode(), b"\x00", request_id.encode()))
    return hmac.new(key, body, hashlib.sha256).digest()[:TOKEN_BYTES]


def same_capability(given: bytes, issued: bytes) -> bool:
    """Constant-time; an empty token never matches."""
    return bool(issued) and hmac.compare_digest(given, issued)


def completion_notif(request_id: str, capability: bytes) -> bytes:
    """Decode's "done" notification: ``request_id#<hex token>``."""
    return request_id.encode() + _NOTIF_SEP + capability.hex().encode()


def parse_notif(data: bytes) -> tuple[str, bytes]:
    """(request id, token) of a notification; token b"" if it carries none."""
    data = bytes(data)
    if len(data) > _NOTIF_TAIL and data[-_NOTIF_TAIL:-_NOTIF_TAIL + 1] == _NOTIF_SEP:
        try:
            token = bytes.fromhex(data[-_NOTIF_TAIL + 1:].decode("ascii"))
        except ValueError:
            token = b""
        if token:
            return data[:-_NOTIF_TAIL].decode(errors="replace"), token
    return data.decode(errors="replace"), b""
