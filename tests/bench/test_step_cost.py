"""bench.step_cost's arithmetic: hook milliseconds per engine step from two scrapes of the
``vllm:kvstage_hook_*`` counters, and the counters read from a real /metrics text served on
127.0.0.1 (`kvstage.serving.client.metric_by_label`)."""

from __future__ import annotations

import http.server
import json
import math
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import step_cost
from bench.ab_stats import ratios
from kvstage.serving.client import metric_by_label

METRICS = """# HELP vllm:kvstage_hook_seconds_total Wall seconds ...
# TYPE vllm:kvstage_hook_seconds_total counter
vllm:kvstage_hook_seconds_total{engine="0",hook="worker.start_load_kv",model_name="m"} 0.5
vllm:kvstage_hook_seconds_total{engine="0",hook="worker.get_transfer_results",model_name="m"} 0.25
vllm:kvstage_hook_seconds_total{engine="1",hook="worker.start_load_kv",model_name="m"} 0.125
vllm:kvstage_hook_seconds_created{engine="0",hook="worker.start_load_kv",model_name="m"} 1.7e9
vllm:kvstage_hook_calls_total{engine="0",hook="worker.get_transfer_results",model_name="m"} 4.0
"""


@pytest.fixture
def server() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join(timeout=10)


def test_metric_by_label_sums_engines_and_skips_other_series(server: str) -> None:
    seconds = metric_by_label(server, "vllm:kvstage_hook_seconds_total", "hook")
    assert seconds == {"worker.start_load_kv": 0.625, "worker.get_transfer_results": 0.25}
    assert metric_by_label(server, "vllm:kvstage_hook_calls_total", "hook") == {
        "worker.get_transfer_results": 4.0}
    assert metric_by_label(server, "vllm:absent_total", "hook") == {}


def test_hook_ms_per_step_divides_each_side_by_its_steps() -> None:
    before = ({"worker.start_load_kv": 1.0, "scheduler.build_connector_meta": 0.5},
              {"worker.get_transfer_results": 100.0, "scheduler.build_connector_meta": 90.0})
    after = ({"worker.start_load_kv": 1.2, "worker.wait_for_save": 0.1,
              "scheduler.build_connector_meta": 0.54},
             {"worker.get_transfer_results": 300.0, "scheduler.build_connector_meta": 190.0})
    # worker: (0.2 + 0.1) s over 200 steps; scheduler: 0.04 s over 100 steps
    assert step_cost.hook_ms_per_step(before, after) == {"scheduler": 0.4, "worker": 1.5}
    assert step_cost.hook_ms_per_step(before, after, by_hook=True) == {
        "scheduler.build_connector_meta": 0.4, "worker.start_load_kv": 1.0,
        "worker.wait_for_save": 0.5}
    assert step_cost.hook_ms_per_step(after, after) == {}  # no step between: nothing


def test_each_kind_gets_its_connector_config() -> None:
    assert step_cost.kv_config("plain", {"kvstage_log_reads": True}) is None
    consumer = step_cost.kv_config("kvstage-consumer", {"kvstage_log_reads": True})
    nixl = step_cost.kv_config("nixl-consumer", {"kvstage_log_reads": True})
    assert consumer is not None and nixl is not None
    assert consumer["kv_role"] == nixl["kv_role"] == "kv_consumer"
    assert consumer["kv_connector_extra_config"]["kvstage_log_reads"] is True
    assert "kvstage_log_reads" not in nixl.get("kv_connector_extra_config", {})
    # the bench's own connector, found by the servers in the repository
    assert step_cost.kv_config("null-connector", {})["kv_connector_module_path"] == (  # type: ignore[index]
        "bench.null_connector")


def test_the_table_shows_each_ratio_with_its_interval_and_the_trials_mean() -> None:
    base = [[3.0, 3.2], [2.9, 4.0], [3.1, 3.0]]
    rows = []
    for t in range(2):
        trial = []
        for name, scale in (("0-plain", 1.0), ("1-kvstage-consumer", 1.5 + t)):
            gaps = [[g * scale for g in r] for r in base]
            trial.append({"server": name, "ttft_ms": 10.0 * scale, "itl_ms": 3.0 * scale,
                          "cpu_by_thread": {"VLLM::Worker": 1.5}, "cpu_s": 2.0,
                          "hook_ms_per_step": {}, "itl_stats_x": ratios(base, gaps),
                          "ttft_stats_x": ratios([[10.0]] * 3, [[10.0 * scale]] * 3)})
        rows.append(trial)
    text = step_cost.table("pair-consumer", rows)
    assert "| 0 | 1-kvstage-consumer | 15.0 | 4.50 | 1.500 [1.500, 1.500] |" in text
    # over the starts: the geometric mean of 1.5 and 2.5, its t interval (1 degree of freedom)
    half = 12.706 * abs(math.log(2.5 / 1.5)) / 2
    centre = math.sqrt(3.75)
    low, high = (round(centre * math.exp(s), 4) for s in (-half, half))
    over = f"{round(centre, 4):.3f} [{low:.3f}, {high:.3f}]"  # as rounded by across_starts
    assert f"| over 2 starts | 1-kvstage-consumer | | | {over} |" in text
    assert text.count("\n| ") == 2 * 2 + 2 + 1  # rows, means, the header's separator


def test_table_rerenders_a_saved_result_and_refuses_another_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gaps = [[3.0, 3.2], [2.9, 4.0], [3.1, 3.0]]

    def row(name: str, scale: float) -> dict[str, object]:
        return {"server": name, "ttft_ms": 10.0 * scale, "itl_ms": 3.0 * scale,
                "ttft_median_ms": 10.0 * scale, "itl_median_ms": 3.0 * scale,
                "ttft_by_round_ms": [[10.0 * scale]] * 3,
                "gaps_by_round_ms": [[g * scale for g in r] for r in gaps],
                "cpu_by_thread": {}, "cpu_s": 1.0, "hook_ms_per_step": {}}

    saved = tmp_path / "step_cost.json"
    saved.write_text(json.dumps({"results": {"pair-producer": [
        [row("0-plain", 1.0), row("1-kvstage-producer", 1.25)]]}}))
    assert step_cost.main(["--table", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "#### pair-producer" in out
    assert "| 0 | 1-kvstage-producer | 12.5 | 3.75 | " + " | ".join(
        ["1.250 [1.250, 1.250]"] * 5) + " | - |" in out
    saved.write_text(json.dumps({"results": {"pair-producer": [[{"server": "0-plain"}]]}}))
    assert step_cost.main(["--table", str(saved)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"--table {saved}: expected a step_cost.json") and err[-1] == "\n"
    assert err.count("\n") == 1
