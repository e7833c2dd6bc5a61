"""The plots in BENCHMARKS.md redraw from the raw files committed beside them, and a
redraw refuses a file its bench did not write, in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAW = ROOT / "benchmarks"

pytest.importorskip("matplotlib")


def redraw(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize(("argv", "raw"), [
    (["-m", "kvstage.cli", "bench", "copy", "--replot"], "copy-ops.json"),
    (["-m", "bench.host_memory", "--replot"], "host-memory.json"),
    (["-m", "bench.pd_time", "--replot"], "pd-time-affinity.json"),
], ids=["copy-ops", "host-memory", "pd-ttft-phases"])
def test_each_plot_redraws_from_its_raw_file(tmp_path: Path, argv: list[str], raw: str) -> None:
    png = tmp_path / "out.png"
    proc = redraw([*argv, str(RAW / raw), "--plot", str(png)])
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_plot_shown_in_benchmarks_exists() -> None:
    text = (ROOT / "BENCHMARKS.md").read_text()
    shown = [line.split("(", 1)[1].rstrip(")") for line in text.splitlines()
             if line.startswith("![")]
    assert len(shown) >= 3, shown
    for path in shown:
        assert (ROOT / path).is_file(), path


def test_a_replot_of_a_foreign_file_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"nothing": []}')
    proc = redraw(["-m", "kvstage.cli", "bench", "copy", "--replot", str(bad),
                   "--plot", str(tmp_path / "x.png")])
    assert proc.returncode == 2
    assert "neither timings nor op counts" in proc.stderr
