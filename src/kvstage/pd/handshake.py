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
from kvstage.transport.base import Transport

__all__ = ["handshake"]


def handshake(client: SideChannelClient, host: str, port: int, *, engine_id: str,
              layout: KVLayout, host_layout: HostLayout, read_timeout_s: float,
              transport: Transport, any_pool_size: bool = False) -> Remote:
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
        meta.host_base, meta.lease_s,
    )
