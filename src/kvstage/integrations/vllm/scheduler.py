"""The scheduler side of `KVStageConnector`: vLLM's P/D proxy protocol onto pd/'s roles.

Contract
--------
`SchedulerSide` runs in vLLM's engine core, one per instance, and never touches a byte of
KV: it decides, and every worker rank carries out the same decision (`metadata.StepMeta`).

Prefill (a request with ``kv_transfer_params["do_remote_decode"]``, as vLLM's proxy, the
router and ``kvstage serve-pd`` send it):
- each step saves the blocks the step completed (`kvstage.pd.prompt_saves`: attention
  blocks chunk by chunk, state slots and the rest at the prompt's last step);
- at the prompt's last step every rank holds the blocks under its lease, with the
  request's capability (`metadata.capability_of`);
- ``request_finished`` hands the decode the proxy protocol's fields (``remote_block_ids``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port`` (rank 0's;
  rank r listens on ``remote_port + r``), ``tp_size``) plus ``kvstage`` (the protocol
  version and the capability), and keeps the blocks until every rank reports the request
  freed (the decode's notification, a Release, or the lease: `kvstage.pd.prefill`).
- State hybrids (Mamba, GDN, ...): the prefill computes the prompt less its last token and
  the decode that token, as vLLM's own NIXL connector does (the state after N - 1 tokens
  is what the decode continues from).

Decode (``do_remote_prefill``): the prompt's tokens, less that last one for state hybrids,
are loaded asynchronously; ``update_state_after_alloc`` turns the allocation into one
`metadata.Load` per request (local ids as vLLM allocated them, each list clipped as the
prefill clipped its own); a request that loads nothing (a full local prefix hit) or ends
before its READ asks the prefill to release its blocks (``forgets``); one that waits for
its READ (behind others, no free blocks) has the prefill's lease renewed every third of a
lease (``heartbeats``). Parameters that
cannot be loaded from (`parse_remote`: a prefill without kvstage, another protocol
version, a malformed field) fail the load with that one line (``fails``): vLLM's
``kv_load_failure_policy`` decides between an error and a local recompute.

Threads: vLLM's engine-core thread calls every method. No socket, no thread here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from kvstage.integrations.vllm.copies import saved_by_chunk
from kvstage.integrations.vllm.metadata import (
    Ids,
    Load,
    Remote,
    StepMeta,
    capability_of,
)
from kvstage.pd.messages import PROTOCOL_VERSION
from kvstage.pd.prompt_saves import PromptSaves

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")

#: the ``kvstage`` entry of ``kv_transfer_params`` carries the side channel's protocol
#: version (one wire version for both): a decode refuses another
PROTOCOL = PROTOCOL_VERSION
PARAMS_KEY = "kvstage"
MAX_GROUP_BLOCKS = 1 << 20  # a prompt's blocks per group: far beyond any pool served here
_DONE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def parse_remote(params: dict[str, Any], num_groups: int) -> tuple[Remote, Ids] | str:
    """The prefill's address, capability and block ids from a decode request's
    ``kv_transfer_params``, or why they cannot be used (one line)."""
    try:
        host, port = params["remote_host"], params["remote_port"]
        tp_size = params.get("tp_size", 1)
        rid, engine = params["remote_request_id"], params["remote_engine_id"]
        ids = params["remote_block_ids"]
    except (KeyError, TypeError) as e:
        return f"kv_transfer_params lack {e}: is the prefill running KVStageConnector?"
    ours = params.get(PARAMS_KEY)
    if ours is None:
        return (f"the prefill at {host}:{port} does not run kvstage's KV connector (its "
                f"kv_transfer_params carry no {PARAMS_KEY!r} entry): serve prefill and decode "
                "with KVStageConnector")
    if not isinstance(ours, dict) or ours.get("v") != PROTOCOL:
        got = ours.get("v") if isinstance(ours, dict) else ours
        return (f"kv_transfer_params[{PARAMS_KEY!r}] is kvstage protocol {got!r}, expected "
                f"{PROTOCOL}: run the same kvstage version on prefill and decode")
    if not (isinstance(host, str) and host and isinstance(port, int) and 0 < port < 65536
            and isinstance(tp_size, int) and 1 <= tp_size <= 64
            and isinstance(rid, str) and rid and isinstance(engine, str)):
        return "kv_transfer_params: remote_host/remote_port/tp_size/remote_request_id malformed"
    try:
        capability = bytes.fromhex(ours["capability"])
    except (KeyError, TypeError, ValueError):
        return "kv_transfer_params: the kvstage capability is missing or not hex"
    if (not isinstance(ids, list | tuple) or len(ids) != num_groups or not all(
            isinstance(g, list | tuple) and len(g) <= MAX_GROUP_BLOCKS
            and all(isinstance(b, int) and b >= 0 for b in g) for g in ids)):
        return (f"kv_transfer_params: remote_block_ids must be {num_groups} lists of block "
                "ids (one per KV cache group): prefill and decode must serve the same model")
    remote = Remote(host, port, tp_size, engine, rid, capability)
    return remote, [list(g) for g in ids]


class SchedulerSide:
    """The connector's scheduler side (module doc)."""

    def __init__(self, vllm_config: Any, kv_cache_config: KVCacheConfig, *, engine_id: str,
                 key: bytes | None, host: str, port: int, save_by_chunk: bool,
                 lease_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine_id, self.key, self.host, self.port = engine_id, key, host, port
        self.beat_s, self.clock = lease_s / 3, clock
        #: decode: requests waiting for their READ -> (prefill, last renewal)
        self.waiting: dict[str, tuple[Remote, float]] = {}
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        groups = kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        self.num_groups = len(groups)
        self.is_state = [type(s).__name__ == "MambaSpec" for s in specs]
        # vLLM keeps a sliding window's last cdiv(window, block) + 1 blocks (its clip)
        self.window_blocks = [
            -(-int(s.sliding_window) // int(s.block_size)) + 1
            if type(s).__name__ == "SlidingWindowSpec" else 0 for s in specs]
        self.spec_blocks = [int(getattr(s, "num_speculative_blocks", 0) or 0) for s in specs]
        #: tokens the prefill leaves to the decode: the state after N - 1 (state hybrids)
        self.backoff = 1 if any(self.is_state) else 0
        sizes = [int(s.block_size) if saved_by_chunk(s) else None for s in specs]
        self.saves = PromptSaves(sizes, self.clip, by_chunk=save_by_chunk)
        self.saving: dict[str, Request] = {}  # prefill: prompts being saved
        self.final: dict[str, Ids] = {}  # prefill: held requests -> the ids handed out
        self.step = StepMeta()  # what the next build hands the workers
        self.quiet_steps = 0  # builds with nothing for the workers, since the last stats

    # -- ids ------------------------------------------------------------------------------
    def clip(self, ids: tuple[list[int], ...] | Ids) -> tuple[list[int], ...]:
        """The blocks a transfer moves, per group: a sliding window's last blocks, a state
        group's running slot (its speculative scratch slots dropped), all of the rest."""
        out = []
        for g, blocks in enumerate(ids):
            blocks = list(blocks)
            if self.window_blocks[g]:
                blocks = blocks[-self.window_blocks[g]:]
            elif self.is_state[g] and blocks:
                scratch = min(self.spec_blocks[g], len(blocks) - 1)
                blocks = (blocks[:-scratch] if scratch else blocks)[-1:]
            out.append(blocks)
        return tuple(out)

    # -- vLLM's scheduler hooks ---------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            parsed = parse_remote(params, self.num_groups)
            if not isinstance(parsed, str):  # renewed while it waits (`heartbeats`)
                self.waiting[request.request_id] = (parsed[0], self.clock())
            return
        if not (self.backoff and params and params.get("do_remote_decode")):
            return
        if params.get("_kvstage_truncated") or request.num_prompt_tokens <= self.backoff:
            return
        if request.prompt_token_ids is None:
            return  # prompt embeddings: computed whole, as vLLM's connector leaves them
        # The prefill computes N - 1 tokens: the decode continues from that state with the
        # last token (vLLM's NIXL connector does the same; README "The vLLM surface").
        del request.prompt_token_ids[-self.backoff:]
        del request._all_token_ids[-self.backoff:]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        params["_kvstage_truncated"] = True

    def num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not (params and params.get("do_remote_prefill")):
            return 0, False
        total = request.num_prompt_tokens
        if self.backoff and total > self.backoff:
            total -= self.backoff
        count = total - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if params.get("do_remote_decode"):
            self.saving[rid] = request  # (re)scheduled: its blocks follow in the output
            self.saves.add(rid)
            return
        if not params.get("do_remote_prefill"):
            return
        self.waiting.pop(rid, None)
        params["do_remote_prefill"] = False  # one transfer per request
        parsed = parse_remote(params, self.num_groups)
        if isinstance(parsed, str):
            if num_external > 0:
                self.step.fails[rid] = parsed  # the workers report it: the policy decides
            else:
                logger.error("kvstage: request %s: %s", rid, parsed)
            return
        remote, remote_ids = parsed
        if num_external <= 0:
            self.step.forgets[rid] = remote
            return
        local = self.clip(blocks.get_unhashed_block_ids_all_groups())
        self.step.loads[rid] = Load(remote, [list(r) for r in self.clip(remote_ids)],
                                    [list(g) for g in local])

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        self.saving.pop(rid, None)
        self.saves.drop(rid)
        self.waiting.pop(rid, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # ended before it was scheduled: free the remote
            params["do_remote_prefill"] = False
            parsed = parse_remote(params, self.num_groups)
            if not isinstance(parsed, str):
                self.step.forgets[rid] = parsed[0]
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        final = self.final.get(rid)
        if final is None or request.status not in _DONE:
            # aborted or never complete: every rank lets its saved blocks go now
            self.final.pop(rid, None)
            self.step.releases.add(rid)
            return False, None
        capability = capability_of(self.key, self.engine_id, rid)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": final,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            PARAMS_KEY: {"v": PROTOCOL, "capability": capability.hex()},
        }

    def build(self, scheduler_output: SchedulerOutput) -> StepMeta:
        if self.saving:
            self._plan_saves(scheduler_output)
        if self.waiting:
            now = self.clock()
            for rid, (remote, renewed) in self.waiting.items():
                if now - renewed >= self.beat_s:
                    self.step.heartbeats[rid] = remote
                    self.waiting[rid] = (remote, now)
        step, self.step = self.step, StepMeta()
        if step.empty:
            self.quiet_steps += 1
        return step

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self.final.pop(rid, None)  # every rank let it go

    def _plan_saves(self, scheduler_output: SchedulerOutput) -> None:
        num_scheduled = scheduler_output.num_scheduled_tokens
        for rid, new_ids, resumed in yield_req_data(scheduler_output):
            req = self.saving.get(rid)
            if req is None:
                continue
            save = self.saves.step(rid, new_ids, resumed,
                                   req.num_computed_tokens + num_scheduled[rid],
                                   req.num_prompt_tokens)
            if rid not in self.saves:
                del self.saving[rid]  # its prompt completed
            if save is None:
                continue
            if any(save.ids):
                self.step.saves[rid] = [list(g) for g in save.ids]
            if save.final is not None:
                self.final[rid] = [list(g) for g in save.final]
                self.step.holds[rid] = capability_of(self.key, self.engine_id, rid)
