"""What a `NixlTransport`'s agent holds, and the teardown that gives it all back.

`AgentState` is the ledger of one NIXL agent's resources: registrations, prepared and
posted transfer handles, loaded peers, and the final state of each READ. ``close`` undoes
all of it, best effort and never raising, from ``NixlTransport.close``, the finaliser or
atexit. It calls only the agent object it was given: no NIXL import here.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from kvstage.transport.base import MemoryRegion, TransferState

if TYPE_CHECKING:
    import torch


class AgentState:
    """Everything close() must undo; held by the finaliser, so it must not refer to the
    NixlTransport itself (that would keep it alive forever)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.reg_dlists: list[Any] = []
        self.regions: list[MemoryRegion] = []
        self.tensors: list[torch.Tensor] = []  # keeps registered tensors alive
        self.peers: set[str] = set()
        self.peer_meta: dict[bytes, str] = {}  # metadata loaded -> peer name
        self.preps: dict[int, Any] = {}  # prepared descriptor lists (prep_xfer_dlist)
        self.xfers: dict[int, Any] = {}  # our handle id -> nixl_xfer_handle
        self.final: dict[int, TransferState] = {}  # DONE/FAILED seen once, kept
        self.reasons: dict[int, str] = {}
        self.closed = False

    def close(self) -> None:
        """Best effort, never raises: runs from close(), the finaliser or atexit."""
        if self.closed:
            return
        self.closed = True
        agent, self.agent = self.agent, None
        steps: list[tuple[Any, Any]] = [(agent.release_xfer_handle, x) for x in self.xfers.values()]
        steps += [(agent.release_dlist_handle, d) for d in self.preps.values()]
        steps += [(agent.remove_remote_agent, p) for p in self.peers]
        steps += [(agent.deregister_memory, r) for r in self.reg_dlists]
        for fn, arg in steps:
            # A dead peer or an uncancellable in-flight READ must not stop the rest.
            with contextlib.suppress(Exception):
                fn(arg)
        for container in (self.xfers, self.final, self.reasons, self.peers, self.peer_meta,
                          self.preps):
            container.clear()
        self.reg_dlists.clear()
        self.regions.clear()
        self.tensors.clear()
