"""Opt-in end-to-end checksum inside `KVStageConnector` (``kvstage_verify_checksum``).

Contract
--------
``kv_connector_extra_config: {"kvstage_verify_checksum": true}`` on BOTH instances:

- Prefill worker (`WorkerChecksums.after_save`): once a request's saves are complete
  (``save_kv_to_host`` of its prompt's last step, `chunk_saves`), one xxh3-64 per saved
  block over exactly the host bytes the decode's READ writes for its group (`read_extents`,
  `kvstage.pd.integrity.extent_digests`): the tensors the group has layers in, an attention
  page whole, a state page's states only. Bytes no READ writes (a state page's padding, a
  tensor the group has no layer in) keep whatever the block held before on each side, so
  hashing them failed honest transfers once blocks were reused (found serving the tiny
  Granite behind vllm-router). The digests go to the scheduler in vLLM's worker -> scheduler
  channel (``build_connector_worker_meta`` -> `ChecksumMeta` ->
  ``update_connector_output``).
- Prefill scheduler (`SchedulerChecksums`): puts them in the ``kv_transfer_params`` it
  returns for the decode, ``"kvstage_checksums": {"xxh3_64": {"<block id>": "<hex>"}}``.
  vLLM 0.32.0 calls ``request_finished`` in ``update_from_output`` BEFORE
  ``update_connector_output`` of the same step, and a request whose prompt completes in
  that step was saved in it: the dict ``request_finished`` returned is filled in place
  then, before the step's outputs leave the engine core. Digests that came first (the
  prompt completed in an earlier step) are added in ``request_finished`` directly.
- Decode scheduler: hands each request's digests to its worker in the connector metadata
  (``kvstage_checksums`` attribute, read from the request's ``kv_transfer_params``).
- Decode worker (`WorkerChecksums.verify`): when NIXL reports a request's READs DONE
  and before the h2d, hashes the local host rows the READ wrote and compares them with
  the prefill's digest of the remote block each was read from (pairs taken from the end
  of each group, as vLLM's READ pairs them; null blocks skipped). A mismatch, or digests
  missing or malformed, fails the request as a KV load failure (``failed_recving``): no
  h2d, and vLLM's ``kv_load_failure_policy`` applies (``fail``: the request ends with an
  error; ``recompute``: it is recomputed locally).

The digests' wire form, their pairing and the comparison are `kvstage.pd.integrity`'s and
`kvstage.pd.reads.pair_blocks`'s (the CLI roles use the same); this module only moves them
through vLLM's channels. Faults are injected from outside (tests/faults/).

Threads: the worker parts run in vLLM's worker step, the scheduler parts in its
scheduler step; nothing here starts a thread. Kernel blocks per logical block must be 1
(checked at registration) and an instance must have one worker (TP = PP = 1, checked at
start): the digests are keyed by the block ids both sides READ with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.logger import init_logger

from kvstage.pd.integrity import (
    Extent,
    describe,
    extent_digests,
    from_params,
    mismatches,
    to_params,
    views_digests,
)
from kvstage.pd.reads import pair_blocks

logger = init_logger(f"vllm.{__name__}")

VERIFY_KEY = "kvstage_verify_checksum"
PARAMS_KEY = "kvstage_checksums"

Digests = dict[int, int]  # block id -> xxh3-64


@dataclass
class ChecksumMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the digests of the requests saved this step."""

    digests: dict[str, Digests] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, ChecksumMeta):
            self.digests.update(other.digests)
        return self


def read_extents(layout: Any) -> list[list[Extent]]:
    """Per KV cache group of a connector layout (`kvstage.layout.KVLayout`): the bytes of a
    block's row that vLLM's READ writes: every tensor the group has a layer in (position t
    of the group is physical tensor t); an attention page whole, a state page's states
    only (conv then SSM from byte 0; its padding is not read)."""
    from kvstage.layout import MambaSpec

    out = []
    for group in layout.groups:
        spec = group.spec
        end = spec.state_bytes if isinstance(spec, MambaSpec) else layout.page_size_bytes
        out.append([(t, 0, end) for t in range(len(group.layer_names))])
    return out


class WorkerChecksums:
    """Both roles' worker side; inert unless enabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._views: list[torch.Tensor] = []
        self._extents: list[list[Extent]] | None = None  # per KV cache group
        self._saved: dict[str, Digests] = {}  # digests not yet sent to the scheduler
        self._expected: dict[str, Any] = {}  # decode: request id -> params value

    def attach(self, views: list[torch.Tensor], kernel_blocks_per_block: int,
               extents: list[list[Extent]] | None = None) -> None:
        """The host buffer's per-physical-tensor ``[P, NB, E]`` views and, per KV cache
        group, the extents a READ of one of its blocks writes (`read_extents`; None: every
        tensor's whole row, for every group)."""
        if self.enabled and kernel_blocks_per_block != 1:
            raise ValueError(
                f"{VERIFY_KEY} needs one kernel block per KV block, got "
                f"{kernel_blocks_per_block}; turn the checksum off for this model"
            )
        self._views = views
        self._extents = extents

    def _digests(self, group: int, ids: list[int]) -> list[int]:
        if self._extents is None:
            return views_digests(self._views, ids)
        return extent_digests(self._views, self._extents[group], ids)

    def after_save(self, final: Mapping[str, Sequence[Sequence[int]]]) -> None:
        """Prefill: digest every request whose saves just completed, over the blocks the
        decode READs (per group: ``saves_final`` of the step's metadata)."""
        if not self.enabled:
            return
        for req_id, groups in final.items():
            saved: Digests = {}
            for group, blocks in enumerate(groups):
                ids = sorted({b for b in blocks if b})
                saved.update(zip(ids, self._digests(group, ids), strict=True))
            self._saved[req_id] = saved

    def worker_meta(self) -> ChecksumMeta | None:
        if not self._saved:
            return None
        meta, self._saved = ChecksumMeta(self._saved), {}
        return meta

    def expect(self, metadata: Any) -> None:
        """Decode: remember the digests the scheduler handed over with the READs."""
        if self.enabled:
            self._expected.update(getattr(metadata, "kvstage_checksums", {}))

    def verify(self, done: Iterable[str], recving: Mapping[str, Any]) -> set[str]:
        """Decode: the requests among ``done`` (READs over, h2d not done) whose bytes do
        not match the prefill's digests; each is logged with the blocks that differ."""
        bad: set[str] = set()
        if not self.enabled:
            return bad
        for req_id in done:
            meta = recving.get(req_id)
            value = self._expected.pop(req_id, None)
            if meta is None or meta.remote is None:
                continue
            # as vLLM's READ paired them: from the end of each group, null blocks skipped
            pairs = pair_blocks(meta.remote.block_ids, meta.local_physical_block_ids,
                                lenient=True)
            if not pairs:
                continue
            want = from_params(value)
            if want is None:
                bad.add(req_id)
                logger.error(
                    "kvstage checksum: request %s came without valid %s in its "
                    "kv_transfer_params; set %s on the prefill instance too. Failing its "
                    "KV load", req_id, PARAMS_KEY, VERIFY_KEY)
                continue
            got: dict[int, int] = {}  # local block -> digest, one call per group
            for group in {g for g, _, _ in pairs}:
                locs = [loc for g, _, loc in pairs if g == group]
                got.update(zip(locs, self._digests(group, locs), strict=True))
            wrong = mismatches([(r, loc) for _, r, loc in pairs], want,
                               [got[loc] for _, _, loc in pairs])
            if wrong:
                bad.add(req_id)
                logger.error("kvstage checksum mismatch for request %s: %s, failing its KV "
                             "load", req_id, describe(wrong, len(pairs), prefix=""))
        return bad


class SchedulerChecksums:
    """Both roles' scheduler side; inert unless enabled."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._digests: dict[str, Digests] = {}  # prefill: arrived before request_finished
        self._waiting: dict[str, dict[str, Any]] = {}  # prefill: params awaiting digests

    def finished(self, req_id: str, params: dict[str, Any] | None) -> None:
        if not self.enabled:
            return
        digests = self._digests.pop(req_id, None)
        if params is None or not params.get("do_remote_prefill"):
            return  # not handed to a decode
        if digests is not None:
            params[PARAMS_KEY] = to_params(digests)
        else:
            self._waiting[req_id] = params  # saved this very step: filled in update()

    def update(self, worker_meta: Any) -> None:
        if not self.enabled:
            return
        if isinstance(worker_meta, ChecksumMeta):
            for req_id, digests in worker_meta.digests.items():
                params = self._waiting.pop(req_id, None)
                if params is not None:
                    params[PARAMS_KEY] = to_params(digests)
                else:
                    self._digests[req_id] = digests
        for req_id in self._waiting:  # the decode will fail these loads (no digests)
            logger.error("kvstage checksum: no digests for request %s when it finished",
                         req_id)
        self._waiting.clear()
