"""Short soaks (`python -m bench.soak`): loopback through its `main`, and real NIXL with the
prefill workers in child processes. The invariants are asserted exactly: every request
has the outcome its injected fault calls for, completed ones are byte-exact, no block,
handle or held request is left on either side."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from bench.soak import main as soak_main

HAVE_NIXL = any(importlib.util.find_spec(n) is not None for n in ("nixl_cu12", "nixl"))


def soak(tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any]]:
    """Run the soak through its `main`; (exit code, its JSON report)."""
    out = tmp_path / "soak.json"
    code = soak_main([*argv, "--json", str(out)])
    return code, json.loads(out.read_text())


def assert_invariants(rep: dict[str, Any], requests: int) -> None:
    assert rep["broken"] == []
    assert rep["requests"] == requests
    outcomes = rep["outcomes"]
    assert sum(outcomes.values()) == requests  # every request accounted for
    assert "unfinished" not in outcomes and "corrupt" not in outcomes
    assert "other_failure" not in outcomes and "transport_error" not in outcomes
    for fault, counts in rep["by_fault"].items():
        assert counts == {rep["expected"][fault]: sum(counts.values())}, (fault, counts)
    assert rep["by_fault"]["none"] == {"completed": rep["by_fault"]["none"]["completed"]}
    for p in rep["pairs"]:
        total = p["decode_total"]
        assert (p["decode_free"], p["prefill_free"]) == (total, total), p
        assert p["decode_open_handles"] == p["decode_draining"] == p["decode_pending"] == 0, p
        assert p["prefill_open_handles"] == p["prefill_held_requests"] == 0, p
        assert p["prefilled"] == p["completed"] + p["released"] + p["expired"], p
        assert p["prefilled"] > 0, p  # every pair served requests
    assert set(rep["rss_bytes"]) == {"10%", "50%", "100%"}
    hostile = rep["hostile"]  # a key holder forging at a share of the requests
    assert hostile["forged_accepted"] == 0 and set(hostile["accepted"].values()) == {0}
    assert hostile["forged_tried"] > 0 and all(hostile["tried"].values()), hostile


@pytest.mark.timeout(120)
def test_soak_loopback_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    code = soak_main(["--transport", "loopback", "--requests", "150",
                      "--fault-rate", "0.2", "--seed", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "all invariants hold" in printed
    rep = json.loads(out.read_text())
    assert_invariants(rep, 150)
    assert set(rep["by_fault"]) == {"none", *rep["fault_kinds"]}  # seed 3 injects every kind
    assert len(rep["records"]) == 150
    assert all(r["reason"] for r in rep["records"] if r["outcome"] != "completed")
    assert rep["config"]["requests"] == 150 and "env" in rep


@pytest.mark.nixl
@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL not installed (kvstage[nixl])")
@pytest.mark.timeout(300)
def test_soak_nixl(tmp_path: Path) -> None:
    # two presets keep CI short: a hybrid one (7 groups) and MLA (one plane)
    code, rep = soak(tmp_path, "--transport", "nixl", "--requests", "60",
                     "--fault-rate", "0.2", "--seed", "5",
                     "--presets", "gemma-3-1b", "deepseek-v2-lite")
    assert code == 0, rep["broken"]
    assert_invariants(rep, 60)
    assert {p["transport"] for p in rep["pairs"]} == {"nixl", "loopback"}
    faults = set(rep["by_fault"]) - {"none"}
    assert len(faults) >= 3, rep["by_fault"]


@pytest.mark.timeout(60)
def test_soak_refuses_a_broken_invariant(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a decode block that never comes back must fail the run."""
    from kvstage.pd.decode import DecodeWorker

    real_finish = DecodeWorker.finish
    leaked: list[str] = []

    def leaky_finish(self: DecodeWorker, request_id: str) -> None:
        if not leaked:
            leaked.append(request_id)
            self._owned.pop(request_id)  # forget the blocks: a leak
            return
        real_finish(self, request_id)

    monkeypatch.setattr(DecodeWorker, "finish", leaky_finish)
    code, rep = soak(tmp_path, "--transport", "loopback", "--requests", "30", "--fault-rate",
                     "0", "--presets", "llama-3.1-8b")
    assert code == 1 and leaked
    assert any("decode pool has" in b and "(leak)" in b for b in rep["broken"])


@pytest.mark.timeout(60)
def test_soak_refuses_an_accepted_forgery(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a prefill that honours any capability must fail the run."""
    from kvstage.pd.prefill import PrefillWorker

    real = PrefillWorker._authorized

    def trusting(self: PrefillWorker, request_id: str, capability: bytes) -> object:
        req = self._requests.get(request_id)  # every forgery carries the right token
        return real(self, request_id, req.capability if req is not None else capability)

    monkeypatch.setattr(PrefillWorker, "_authorized", trusting)
    code, rep = soak(tmp_path, "--transport", "loopback", "--requests", "30", "--fault-rate",
                     "0", "--presets", "llama-3.1-8b", "--hostile-rate", "0.5")
    assert code == 1
    assert rep["hostile"]["accepted"]["release"] > 0
    assert any(b.startswith("forged state changes accepted: ") for b in rep["broken"])
