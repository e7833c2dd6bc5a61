"""What the scheduler side of `KVStageConnector` tells every worker rank, once per step.

Contract
--------
`StepMeta` is vLLM's ``KVConnectorMetadata`` for one engine step, built by the scheduler
(`scheduler.SchedulerSide.build`) and handed by vLLM, identical, to every worker rank: a
step is the same step on every rank, whatever each rank's clock says. Fields:

- ``saves``: request id -> block ids per KV cache group to copy device -> host after this
  step's forward (the prefill's d2h, chunk by chunk: `kvstage.pd.prompt_saves`).
- ``holds``: requests whose prompt completed in this step: after their saves every rank
  holds the blocks under its lease (`kvstage.pd.prefill.PrefillWorker.hold`) with the
  capability the scheduler hands to the decode (`capability_of`).
- ``releases``: requests that ended before their hold (aborted, preempted for good): every
  rank lets their saved blocks go.
- ``loads``: request id -> `Load` (the decode's READ of a remote prefill into local ids).
- ``forgets``: requests whose remote blocks the decode will not read (a full local prefix
  hit, an abort before the READ): every rank asks its prefill peer to release them.
- ``heartbeats``: requests waiting at the decode for their READ (queued behind others,
  no blocks free yet): every rank renews its prefill peer's lease on them (kvstage's
  Acquire, which extends a lease up to the prefill's bound on a hold), so a request that
  waits longer than a lease is still held when its READ starts.
- ``fails``: request id -> why its ``kv_transfer_params`` cannot be loaded from (a prefill
  that does not run kvstage, another protocol version, malformed fields): every rank
  reports the load failed, and vLLM's ``kv_load_failure_policy`` decides (``fail`` ends
  the request, ``recompute`` computes the prompt here).

Everything is plain data (lists, ints, strings): vLLM pickles it to the workers. An empty
step pickles to a few dozen bytes (`EMPTY` is shared).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstage.pd import auth

Ids = list[list[int]]


@dataclass(frozen=True)
class Remote:
    """Where a request's prefill lives: rank r's side channel is ``host:port + r``."""

    host: str
    port: int
    tp_size: int
    engine_id: str
    request_id: str
    capability: bytes


@dataclass(frozen=True)
class Load:
    """One decode READ: the prefill's ids (per group) into these local ids."""

    remote: Remote
    remote_block_ids: Ids
    local_block_ids: Ids


@dataclass
class StepMeta(KVConnectorMetadata):
    saves: dict[str, Ids] = field(default_factory=dict)
    holds: dict[str, bytes] = field(default_factory=dict)  # request id -> capability
    releases: set[str] = field(default_factory=set)
    loads: dict[str, Load] = field(default_factory=dict)
    forgets: dict[str, Remote] = field(default_factory=dict)
    fails: dict[str, str] = field(default_factory=dict)  # request id -> why
    heartbeats: dict[str, Remote] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.saves or self.holds or self.releases or self.loads or self.forgets
                    or self.fails or self.heartbeats)


def capability_of(key: bytes | None, engine_id: str, request_id: str) -> bytes:
    """The request's capability, derived (never stored) so that the scheduler, which hands
    it to the decode, and every worker rank, which checks it, agree without talking. With a
    shared key it is unguessable (`auth.derived_capability`); without one the side channel
    is unauthenticated anyway (loopback, or opted in) and the engine id stands in."""
    return auth.derived_capability(key or engine_id.encode(), engine_id, request_id)
