"""Side-channel messages (msgspec, tagged, versioned) and the KVLayout codec.

Every message carries ``version``; a peer that speaks another version is refused with
an error naming both versions, before any field is trusted.
"""

from __future__ import annotations

import msgspec

from kvstage.errors import LayoutMismatch, ProtocolMismatch
from kvstage.layout import (
    CacheLayout,
    FullAttentionSpec,
    KVGroup,
    KVLayout,
    KVSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

PROTOCOL_VERSION = 3  # 2: Error carries a code; 3: envelopes (auth.py), capabilities
#: the largest side-channel message accepted (a Meta with a 100-layer layout and NIXL's
#: agent metadata is ~10 KiB)
MAX_MESSAGE_BYTES = 1 << 20


class SpecMsg(msgspec.Struct, frozen=True):
    kind: str  # "full" | "sliding_window" | "mla" | "state"
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int = 0
    # "state" (MambaSpec) only; bounded: at most MAX_STATES states of MAX_STATE_DIMS dims
    shapes: list[list[int]] = msgspec.field(default_factory=list)
    dtypes: list[str] = msgspec.field(default_factory=list)
    page_size_padded: int = 0
    mamba_type: str = ""
    conv_layout: str = ""
    num_speculative_blocks: int = 0


MAX_STATES, MAX_STATE_DIMS = 8, 8


class GroupMsg(msgspec.Struct, frozen=True):
    group_id: int
    layer_names: list[str]
    spec: SpecMsg


class LayoutMsg(msgspec.Struct, frozen=True):
    num_blocks: int
    cache_layout: str
    name: str
    groups: list[GroupMsg]


class Message(msgspec.Struct, tag_field="type", kw_only=True):
    version: int = PROTOCOL_VERSION


class GetMeta(Message, tag="get_meta"):
    engine_id: str


class Meta(Message, tag="meta"):
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: LayoutMsg
    host_layout: str
    host_base: int
    host_nbytes: int
    lease_s: float
    #: across TP sizes (`kvstage.pd.tp_parts`): this rank's TP size and rank, the decode TP
    #: its host buffer was cut for, into ``num_slices`` slices of this signature ("" and 0:
    #: equal sizes, whole pages)
    tp_size: int = 0
    tp_rank: int = 0
    peer_tp_size: int = 0
    num_slices: int = 1
    parts: str = ""


class PrefillRequest(Message, tag="prefill"):
    """Ask the prefill worker to 'run' a prompt: allocate blocks, write KV, d2h."""

    request_id: str
    num_tokens: int
    seed: int


class PrefillDone(Message, tag="prefill_done"):
    request_id: str
    block_ids: list[list[int]]
    d2h_s: float
    nbytes: int
    lease_s: float
    #: the request's capability: Acquire, Release and the completion notification must
    #: carry it (`kvstage.pd.auth`); hand it to decode with the block ids
    capability: bytes = b""
    #: per-block xxh3-64 digests aligned with block_ids (`kvstage.pd.integrity`); empty
    #: when prefill runs without verify_checksum
    checksums: list[list[int]] = msgspec.field(default_factory=list)


class GetStats(Message, tag="get_stats"):
    pass


class Acquire(Message, tag="acquire"):
    """Decode is about to READ a request: confirm its blocks are held, extend the lease
    (up to the prefill's max_hold_s in total)."""

    request_id: str
    capability: bytes = b""
    #: the slice this decode reads (across TP sizes): the Lease's checksums are its
    slice_index: int = 0


class Lease(Message, tag="lease"):
    request_id: str
    remaining_s: float
    checksums: list[list[int]] = msgspec.field(default_factory=list)  # as PrefillDone's
    #: the answering prefill's engine id: another than the handshake's means the prefill
    #: restarted on the same address (a new NIXL agent): the decode handshakes again
    engine_id: str = ""


class Stats(Message, tag="stats"):
    held_requests: int
    held_blocks: int
    free_blocks: int
    prefilled: int
    completed: int
    released: int
    expired: int
    unknown_notifs: list[str]  # the last few (bounded), for people
    open_handles: int
    num_unknown_notifs: int = 0
    unauthorized: int = 0  # messages refused: no/wrong MAC, stale, replayed
    bad_capability: int = 0  # Acquire/Release/notification with a wrong or missing token


class Release(Message, tag="release"):
    """Free a request's blocks now (what a decode abort sends, so prefill need not wait
    for the lease)."""

    request_id: str
    capability: bytes = b""


class Ok(Message, tag="ok"):
    pass


class Error(Message, tag="error"):
    """A refusal: ``code`` is one of `kvstage.errors.KINDS` (callers branch on it),
    ``message`` is for people."""

    message: str
    code: str = "error"


AnyMessage = (
    GetMeta | Meta | PrefillRequest | PrefillDone | Acquire | Lease | GetStats | Stats | Release
    | Ok | Error
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)
_probe = msgspec.msgpack.Decoder(dict)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> AnyMessage:
    """Decode one message; a garbled or foreign one raises ValueError saying what arrived."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolMismatch(
            f"side-channel message of {len(data)} bytes; at most {MAX_MESSAGE_BYTES} accepted"
        )
    try:
        head = _probe.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ProtocolMismatch(
            f"side-channel message is not a kvstage message ({len(data)} bytes, "
            f"starts {data[:16]!r}): {exc}"
        ) from None
    version = head.get("version")
    if version != PROTOCOL_VERSION:
        raise ProtocolMismatch(
            f"peer speaks side-channel protocol version {version!r}, this kvstage speaks "
            f"{PROTOCOL_VERSION}: run the same kvstage version on prefill and decode"
        )
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ProtocolMismatch(
            f"malformed side-channel message {str(head.get('type'))[:32]!r}: {exc}"
        ) from None


def layout_to_msg(layout: KVLayout) -> LayoutMsg:
    groups = []
    for g in layout.groups:
        s = g.spec
        kind = (
            "mla"
            if isinstance(s, MLASpec)
            else "sliding_window"
            if isinstance(s, SlidingWindowSpec)
            else "full"
        )
        if isinstance(s, MambaSpec):
            spec = SpecMsg(
                "state", s.block_size, 0, 0, s.dtype, shapes=[list(x) for x in s.shapes],
                dtypes=list(s.dtypes), page_size_padded=s.page_size_padded or 0,
                mamba_type=s.mamba_type, conv_layout=s.conv_layout,
                num_speculative_blocks=s.num_speculative_blocks,
            )
            groups.append(GroupMsg(g.group_id, list(g.layer_names), spec))
            continue
        window = s.sliding_window if isinstance(s, SlidingWindowSpec) else 0
        spec = SpecMsg(kind, s.block_size, s.num_kv_heads, s.head_size, s.dtype, window)
        groups.append(GroupMsg(g.group_id, list(g.layer_names), spec))
    return LayoutMsg(layout.num_blocks, layout.cache_layout.value, layout.name, groups)


def layout_from_msg(msg: LayoutMsg) -> KVLayout:
    groups = []
    for g in msg.groups:
        s = g.spec
        bs, heads, size, dtype = s.block_size, s.num_kv_heads, s.head_size, s.dtype
        spec: KVSpec
        if s.kind == "state":
            spec = _state_spec(s)
        elif s.kind == "mla":
            spec = MLASpec(block_size=bs, num_kv_heads=heads, head_size=size, dtype=dtype)
        elif s.kind == "sliding_window":
            spec = SlidingWindowSpec(
                block_size=bs, num_kv_heads=heads, head_size=size, dtype=dtype,
                sliding_window=s.sliding_window,
            )
        elif s.kind == "full":
            spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=size, dtype=dtype)
        else:
            raise LayoutMismatch(f"unknown KV spec kind {s.kind[:32]!r} from peer")
        groups.append(KVGroup(group_id=g.group_id, layer_names=tuple(g.layer_names), spec=spec))
    return KVLayout(
        num_blocks=msg.num_blocks,
        groups=tuple(groups),
        cache_layout=CacheLayout(msg.cache_layout),
        name=msg.name,
    )


def _state_spec(s: SpecMsg) -> MambaSpec:
    if len(s.shapes) > MAX_STATES or any(len(x) > MAX_STATE_DIMS for x in s.shapes):
        raise LayoutMismatch(
            f"a peer's state spec has {len(s.shapes)} states (at most {MAX_STATES} of "
            f"{MAX_STATE_DIMS} dims accepted)"
        )
    return MambaSpec(
        block_size=s.block_size, shapes=tuple(tuple(x) for x in s.shapes),
        dtypes=tuple(s.dtypes), page_size_padded=s.page_size_padded or None,
        mamba_type=s.mamba_type, conv_layout=s.conv_layout,
        num_speculative_blocks=s.num_speculative_blocks,
    )
