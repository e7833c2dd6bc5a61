"""What the serving fault tests share: bounded waits, vLLM's /metrics read as exact counts,
the router's first stage by hand, and the exact error answers vLLM and vllm-router give.

Everything speaks HTTP to running servers (`kvstage.serving`); nothing imports vLLM. Every
wait is bounded (`WAIT_S`, `REQUEST_TIMEOUT_S`) and fails the test when it runs out.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvstage.serving import Instance, Result, complete, metric_total
from kvstage.serving.instances import http_get
from kvstage.testing.vllm_engines import PREFILL_REQUEST_PARAMS

REQUESTS = "vllm:request_success_total"  # vLLM's counter of finished requests
REQUEST_TIMEOUT_S = 120.0  # the client's bound on every request
WAIT_S = 120.0  # bound on every state a test waits for
RELEASED = "lease ended, blocks freed for request"  # the connector's line when a lease ends
# vllm-router checks each worker's /health every 60 s by default and takes a worker back
# after 2 good checks in a row: up to 2 min after an instance is back. Every 5 s here.
ROUTER_ARGS = ("--health-check-interval-secs", "5")
# what vllm-router answers while it holds no healthy prefill (or decode)
NO_WORKERS = "HTTP 503: No available workers: "
# vLLM's answer for a request whose KV load failed under the "fail" policy
LOAD_FAILED = '"type":"InternalServerError"'


def report(what: str, value: object) -> None:
    print(f"serving-faults: {what}: {value}", flush=True)


def wait_until(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> float:
    """Poll ``check`` until true; the seconds it took. Fails the test after ``timeout``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in ``GET /metrics`` whose labels include ``labels``."""
    status, body = http_get(url + "/metrics")
    assert status == 200, f"GET {url}/metrics answered {status}"
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in body.decode().splitlines():
        sample_of_name = line.startswith(name) and line[len(name):len(name) + 1] in ("{", " ")
        if sample_of_name and all(w in line for w in want):
            total += float(line.rsplit(" ", 1)[1])
    return total


def used_blocks(url: str) -> int:
    """KV blocks in use: vLLM's usage gauge is 1 - free / (num_gpu_blocks - 1)."""
    status, body = http_get(url + "/metrics")
    assert status == 200, f"GET {url}/metrics answered {status}"
    text = body.decode()
    found = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.M)
    assert found, "no num_gpu_blocks in vllm:cache_config_info"
    usable = int(found.group(1)) - 1  # minus vLLM's null block
    used = metric(url, "vllm:kv_cache_usage_perc") * usable
    assert abs(used - round(used)) < 1e-6, f"usage gauge x {usable} blocks = {used}"
    return round(used)


def prefill_only(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """The router's first stage by hand (max_tokens 1, do_remote_decode): the prefill's
    ``kv_transfer_params``, which no decode will ever read."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": dict(PREFILL_REQUEST_PARAMS)}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:  # noqa: S310
        params: dict[str, Any] = json.loads(resp.read(1 << 20))["kv_transfer_params"]
    return params


def log_count(inst: Instance, text: str) -> int:
    return inst.log_path.read_text(errors="replace").count(text)


def send(pool: ThreadPoolExecutor, url: str, prompts: list[list[int]],
         max_tokens: int) -> Future[list[Result]]:
    """All ``prompts`` in flight at once, in the background."""
    return pool.submit(complete, url, prompts, max_tokens, concurrency=len(prompts),
                       timeout=REQUEST_TIMEOUT_S)


def wrong(expected: list[list[int]], results: list[Result]) -> list[str]:
    return [f"request {i}: {r.error or r.token_ids} != {e}"
            for i, (e, r) in enumerate(zip(expected, results, strict=True))
            if r.token_ids != e]


def errors_only(results: list[Result], *needles: str) -> list[str]:
    """Requests that did not end with an HTTP 500 whose body holds every needle."""
    return [f"request {i}: {r.error or r.token_ids}" for i, r in enumerate(results)
            if r.error is None or not r.error.startswith("HTTP 500: ")
            or not all(n in r.error for n in needles)]


def check_ok(results: list[Result], where: Instance, lens: Sequence[int]) -> None:
    """Every request answered; else each failure (prompt length, error) and ``where``'s log."""
    failed = [f"prompt {i} ({lens[i]} tokens): {r.error}"
              for i, r in enumerate(results) if not r.ok]
    assert not failed, "\n".join(failed) + f"\n{where.name} log ends:\n{where.log_tail()}"


def served_since(before: dict[str, float], instances: list[Instance], *,
                 expect: int) -> dict[str, int]:
    """Requests each instance finished since ``before`` (vLLM's request_success_total);
    polled (bounded) until ``expect`` in all, as vLLM may count a request just after its
    response went out."""
    deadline = time.monotonic() + 10.0
    while True:
        served = {i.name: int(metric_total(i.url, REQUESTS) - before[i.name])
                  for i in instances}
        if sum(served.values()) >= expect or time.monotonic() > deadline:
            return served
        time.sleep(0.2)


def digested_blocks(params: dict) -> set[int]:
    """The remote block ids a prefill holds a digest for (``kvstage_verify_checksum``), asked
    as a decode asks (kvstage's Acquire on rank 0's side channel, no key; the request stays
    held): the ids of ``params["remote_block_ids"]`` with one digest each (null ids skipped)."""
    from kvstage.pd import messages as m
    from kvstage.pd.integrity import digest_map
    from kvstage.pd.side_channel import SideChannelClient

    client = SideChannelClient(params["remote_host"], params["remote_port"], timeout_s=10.0)
    lease = client.call(m.Acquire(request_id=params["remote_request_id"],
                                  capability=bytes.fromhex(params["kvstage"]["capability"])))
    assert isinstance(lease, m.Lease), lease
    digests = digest_map(params["remote_block_ids"], lease.checksums)
    assert digests is not None, (lease, params)
    return set(digests)
