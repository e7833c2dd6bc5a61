"""`kvstage bench copy`: JSON structure and exact op counts of the quick run (no timings
are asserted: they depend on the machine and on whatever else runs on it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstage.cli import main

NUM_LAYERS = 16  # the --quick default, as in the PR's table


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "copy.json"
    assert main(["bench", "copy", "--quick", "--op-counts", "--json", str(path)]) == 0
    return json.loads(Path(path).read_text())


def _ops(doc: dict[str, Any], groups: int, direction: str, strategy: str) -> dict[str, Any]:
    rows = [r for r in doc["op_counts"]
            if (r["groups"], r["direction"], r["strategy"]) == (groups, direction, strategy)]
    return {r["op"]: r for r in rows}


def test_json_echoes_config_and_machine(quick: dict[str, Any]) -> None:
    assert set(quick) >= {"config", "env", "timings", "op_counts", "memory"}
    cfg = quick["config"]
    assert cfg["quick"] is True and cfg["op_counts"] is True
    assert cfg["groups"] == [1, 2, 3, 6] and cfg["num_layers"] == [NUM_LAYERS]
    assert cfg["blocks_per_request"] == 6 and cfg["iters"] >= 1
    assert not any(k.startswith("_") for k in cfg)  # the parser/runner are not echoed
    env = quick["env"]
    assert env["device"] == "cpu" and env["torch"] and env["cpu_count"] >= 1
    assert quick["memory"] == []  # --memory was not asked for


def test_timing_rows_cover_every_strategy_and_verify(quick: dict[str, Any]) -> None:
    rows = quick["timings"]
    keys = {(r["groups"], r["direction"], r["strategy"]) for r in rows}
    for g in (1, 2, 3, 6):
        for d in ("d2h", "h2d"):
            for s in ("per_group", "coalesced", "fused", "memcpy", "fused plan",
                      "fused copies"):
                assert (g, d, s) in keys
    for r in rows:
        assert 0 < r["min_us"] <= r["median_us"]
        assert r["samples"] == quick["config"]["iters"]
        assert r["min_bytes"] == r["blocks"] * r["num_tensors"] * 32768  # 32 KiB pages
        if r["strategy"] in ("per_group", "coalesced", "fused"):
            assert r["verified"] is True  # destination blocks equal the source blocks
        if r["strategy"] in ("per_group", "coalesced"):  # vLLM moves ids x layers x page
            assert r["nbytes"] == r["blocks"] * NUM_LAYERS * 32768
        if r["strategy"] in ("fused", "memcpy", "fused copies"):
            assert r["nbytes"] == r["min_bytes"]
        if r["strategy"] == "fused copies":  # timed, not a strategy: nothing to verify
            assert r["verified"] is None and r["descriptors"] is None


def test_quick_prints_the_overhead_column(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "copy", "--quick", "--groups", "2", "--direction", "h2d",
            "--strategies", "fused", "--iters", "3"]
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert "fused copies us" in header and header.rstrip().endswith("overhead us")


def test_floor_steps_and_baseline(tmp_path: Path) -> None:
    path = tmp_path / "floor.json"
    src = str(Path(__file__).resolve().parents[2] / "src")  # this checkout as the baseline
    argv = ["bench", "copy", "--floor", "--floor-ids", "9", "--iters", "3", "--warmup", "0",
            "--baseline-src", src, "--json", str(path)]
    assert main(argv) == 0
    rows = {r["step"]: r for r in json.loads(path.read_text())["floor"]}
    assert set(rows) == {
        "GroupedBlockIds", "GroupedBlockIds trusted", "plan_copy", "plan_copy scattered",
        "load_to_device", "load_to_device trusted", "run planned", "copies alone", "overhead",
        "overhead trusted", "dispatch",
    }
    assert rows["plan_copy"]["before_us"] > 0 and rows["plan_copy"]["after_us"] > 0
    assert rows["load_to_device trusted"]["before_us"] is None  # only timed for this one
    assert all(r["ids"] == 9 and r["bytes"] == 9 * 4 * 16384 for r in rows.values())


def test_floor_flags_need_floor(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "copy", "--floor-ids", "9"])
    assert exc.value.code == 2 and "need --floor" in capsys.readouterr().err


@pytest.mark.parametrize("groups", [1, 2, 3, 6])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_op_counts_are_exact(quick: dict[str, Any], groups: int, direction: str) -> None:
    per_group = _ops(quick, groups, direction, "per_group")
    coalesced = _ops(quick, groups, direction, "coalesced")
    fused = _ops(quick, groups, direction, "fused")
    for table, index_ops in ((per_group, groups * NUM_LAYERS), (coalesced, NUM_LAYERS)):
        for op in ("index", "index_put_"):
            assert table[op]["profiler"] == table[op]["opcounter"] == index_ops
        assert table["copy_"]["profiler"] == table["copy_"]["opcounter"] == 0
        assert table["data ops"]["opcounter"] == 2 * index_ops  # k = 2 ops per layer
    # contiguous ids 1..6 are one run: one copy op for the whole request
    assert fused["copy_"]["profiler"] == fused["copy_"]["opcounter"] == 1
    assert fused["data ops"]["opcounter"] == 1
    for table in (per_group, coalesced, fused):
        for row in table.values():
            assert row["agree"] in (True, None)
            assert row["matches_expected"] in (True, None)


def test_scattered_ids_memory_and_staged_bound(tmp_path: Path) -> None:
    path = tmp_path / "scattered.json"
    argv = ["bench", "copy", "--quick", "--no-timing", "--op-counts", "--memory", "--ids",
            "scattered", "--groups", "3", "--direction", "h2d", "--blocks-per-request", "12",
            "--max-temp-bytes", str(4 * 196608), "--json", str(path)]
    assert main(argv) == 0
    doc = json.loads(path.read_text())
    fused = {r["op"]: r for r in doc["op_counts"] if r["strategy"] == "fused"}
    assert fused["copy_"]["matches_expected"] is True
    assert fused["copy_"]["opcounter"] == fused["copy_"]["expected"] > 1  # one per run
    mem = {r["strategy"]: r for r in doc["memory"]}
    assert mem["fused direct"]["peak_temp_bytes"] == 0  # slice copies: no temporary
    assert mem["fused staged"]["bounded"] is True
    assert mem["fused staged"]["peak_temp_bytes"] <= 4 * 196608  # 4 blocks of 6 tensors
    assert mem["coalesced"]["peak_temp_bytes"] == 12 * 32768  # one layer's gather


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--blocks-per-request", "2", "--groups", "3"], "every group needs at least one block"),
        (["--num-layers", "2", "--groups", "3"], "exceeds --num-layers"),
        (["--iters", "0"], "must be >= 1"),
        (["--plot", "out.svg"], "ending in .png"),
        (["--preset", "gemma-3-1b", "--groups", "2"], "do not apply with --preset"),
    ],
)
def test_bad_flags_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "copy", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
