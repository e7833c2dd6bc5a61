"""`python -m bench.transfer --pipeline --quick`: runs against real NIXL children and writes
one JSON row per size with every phase and ratio, and one incremental-save row per size
(numbers are not checked: timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl
REPO = Path(__file__).resolve().parents[2]  # `python -m bench.transfer` runs from here
pytest.importorskip("xxhash")


@pytest.mark.timeout(300)
def test_bench_transfer_pipeline_quick(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.transfer", "--pipeline", "--quick",
         "--preset", "llama-3.1-8b", "--num-blocks", "24", "--sizes-mib", "8",
         "--json", str(out), "--plot", str(tmp_path / "pipeline.png")],
        capture_output=True, text=True, timeout=280, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["mib"], r["chunks"]) for r in rows] == [(8, 2)]
    assert set(rows[0]) >= {"d2h_ms", "d2h_hash_ms", "read_ms", "h2d_ms", "seq_ms", "pipe_ms",
                            "seq_ratio", "pipe_ratio", "gbps", "gbps_checksum"}
    saves = json.loads(out.read_text())["saves"]
    assert [(r["mib"], r["chunks"]) for r in saves] == [(8, 4)]
    assert set(saves[0]) >= {"compute_ms", "d2h_ms", "seq_ms", "ovl_ms", "hidden_pct", "max_pct"}
    assert "incremental prefill saves" in proc.stdout
    assert (tmp_path / "pipeline.png").stat().st_size > 0
