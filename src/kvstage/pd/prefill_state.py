"""What `PrefillWorker` keeps per request, and its counters (`PrefillWorker.stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MAX_UNKNOWN_NOTIFS", "PrefillCounters", "SavedRequest"]

MAX_UNKNOWN_NOTIFS = 64  # the record of unknown notifications is bounded


@dataclass
class SavedRequest:
    """A request the worker saved blocks for (held once ``hold`` is called)."""

    block_ids: list[list[int]]
    held: bool = False
    deadline: float = 0.0
    d2h_s: float = 0.0
    nbytes: int = 0
    capability: bytes = b""  # issued by hold()
    hold_until: float = 0.0  # no renewal past this (held at + max_hold_s)
    #: verify_checksum: (slice, id) -> xxh3 (slice 0 only at equal TP sizes)
    digests: dict[tuple[int, int], int] = field(default_factory=dict)
    readers: set[str] = field(default_factory=set)  # decode agents that notified
    unhashed: set[int] = field(default_factory=set)  # saved with wait=False, not hashed yet


@dataclass
class PrefillCounters:
    prefilled: int = 0  # requests held
    completed: int = 0  # freed by a decode notification
    released: int = 0  # freed by an explicit Release
    expired: int = 0  # freed by the lease
    unknown_notifs: list[str] = field(default_factory=list)  # the last MAX_UNKNOWN_NOTIFS
    num_unknown_notifs: int = 0
    unauthorized: int = 0  # side-channel messages refused (no/wrong MAC, stale, replayed)
    bad_capability: int = 0  # Acquire/Release/notification with a wrong or missing token

    def unknown(self, request_id: str) -> None:
        """A notification for no held request (late, duplicated or foreign): counted, the
        last ``MAX_UNKNOWN_NOTIFS`` ids kept (64 characters each)."""
        self.num_unknown_notifs += 1
        self.unknown_notifs.append(request_id[:64])
        del self.unknown_notifs[:-MAX_UNKNOWN_NOTIFS]
