"""The decode side's handshake with one prefill: its agent metadata and layout, checked.

`handshake` asks the prefill's side channel for `Meta` (authenticated when the client
has a key), refuses what cannot work before any READ (another layout, another host
layout, a READ timeout not below the prefill's lease, agent metadata this transport
cannot load) with the error kind callers act on, and loads the peer into the transport.
`DecodeWorker.connect` caches the result per address.
"""

from __future__ import annotations

import dataclasses

from kvstage.cache import HostLayout
from kvstage.errors import InvalidRequest, KVStageError, LayoutMismatch, ProtocolMismatch
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd.reads import Remote
from kvstage.pd.side_channel import SideChannelClient
from kvstage.pd.tp_parts import TPSide
from kvstage.transport.base import Transport

__all__ = ["handshake"]


def handshake(client: SideChannelClient, host: str, port: int, *, engine_id: str,
              layout: KVLayout, host_layout: HostLayout, read_timeout_s: float,
              transport: Transport, any_pool_size: bool = False, tp: TPSide | None = None,
              slice_index: int = 0, num_slices: int = 1) -> Remote:
    """Fetch and check the prefill at ``host:port``'s metadata; add it as a peer.
    ``any_pool_size``: a block-major prefill may hold another number of blocks (an engine
    sizes its pool from its memory; a row is one block either way): the READ's remote ids
    are then checked against the prefill's own count (`reads.Poster.remote_descs`)."""
    meta = client.call(m.GetMeta(engine_id=engine_id))
    if not isinstance(meta, m.Meta):
        raise ProtocolMismatch(
            f"{host}:{port} answered GetMeta with {type(meta).__name__}"
        )
    remote_layout = m.layout_from_msg(meta.layout)
    base = meta.host_base
    if tp is not None or meta.parts:  # across TP sizes: the slices must be what we read
        base += slice_index * remote_layout.num_blocks * _check_parts(
            meta, tp, num_slices, host, port)
    else:
        checked = remote_layout
        if any_pool_size and host_layout is HostLayout.BLOCK_MAJOR:
            checked = dataclasses.replace(remote_layout, num_blocks=layout.num_blocks)
        try:
            layout.check_compatible(checked)
        except ValueError as exc:
            raise LayoutMismatch(str(exc)) from None
    if meta.host_layout != host_layout.value:
        raise LayoutMismatch(
            f"incompatible host buffer: host_layout is {host_layout.value!r} "
            f"here, {meta.host_layout!r} remote; start both sides with the same one"
        )
    if read_timeout_s >= meta.lease_s:
        raise InvalidRequest(
            f"read_timeout_s ({read_timeout_s}) must be below the prefill lease "
            f"({meta.lease_s} s), else a READ could outlive the blocks it reads"
        )
    try:
        peer = transport.add_peer(meta.agent_metadata)
    except KVStageError:
        raise
    except Exception as exc:  # e.g. a loopback decode given a NIXL prefill's metadata
        raise ProtocolMismatch(
            f"cannot use the agent metadata of {host}:{port} with this decode's "
            f"{type(transport).__name__}: {type(exc).__name__}; run both sides "
            "with the same --transport"
        ) from None
    return Remote(
        host, port, meta.engine_id, peer, remote_layout, host_layout,
        base, meta.lease_s,
    )


def _check_parts(meta: m.Meta, tp: TPSide | None, num_slices: int, host: str,
                 port: int) -> int:
    """The row bytes of the prefill's slices, once they are what this decode reads: cut for
    this decode's TP size, into the slices of the mapping, each holding the bytes of our
    region in our order (`kvstage.pd.tp_parts`); else LayoutMismatch in one line."""
    at = f"prefill {host}:{port} (TP {meta.tp_size or '?'} rank {meta.tp_rank})"
    if tp is None:
        raise LayoutMismatch(
            f"{at} cut its host buffer for decode TP {meta.peer_tp_size} but this decode "
            "reads whole pages of a prefill at its own TP size; start the decode with "
            f"kvstage_peer_tp_size={meta.tp_size} (and the prefill with this decode's TP), "
            "or both at one TP size")
    if not meta.parts:
        raise LayoutMismatch(
            f"{at} holds whole pages for a decode at its own TP size; this decode (TP "
            f"{tp.size}) was started for prefill TP {tp.peer_size}: start the prefill with "
            f"kvstage_peer_tp_size={tp.size}")
    if meta.peer_tp_size != tp.size or meta.tp_size != tp.peer_size:
        raise LayoutMismatch(
            f"{at} was started for decode TP {meta.peer_tp_size}; this decode is TP "
            f"{tp.size} and expects prefill TP {tp.peer_size}: set kvstage_peer_tp_size to "
            "the other side's TP size on both")
    mine = tp.parts.signature()
    if meta.num_slices != num_slices or meta.parts != mine:
        raise LayoutMismatch(
            f"{at} holds {meta.num_slices} slice(s) per block of {meta.parts[:300]}; this "
            f"decode rank reads {num_slices} slice(s) of {mine[:300]} (per tensor: part "
            "bytes, then per group (field, units, bytes per unit)): the two sides' pages do "
            "not split alike (another model, block size or dtype)")
    return tp.parts.row_bytes
