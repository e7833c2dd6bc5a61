"""bench.stream.begin: a bench killed with SIGTERM leaves through its ``finally`` blocks
(where it stops the api_servers it started), with exit status 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROGRAM = """
import argparse, sys, time
from pathlib import Path
from bench.stream import begin
out = Path(sys.argv[1])
def build(path):
    return path
begin(argparse.Namespace(out=str(out), seed=0), build)
try:
    (out / "ready").write_text("")
    time.sleep(60)
finally:
    (out / "stopped").write_text("servers stopped")
"""


def test_sigterm_runs_the_benchs_finally(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path)], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert (tmp_path / "stopped").read_text() == "servers stopped"
