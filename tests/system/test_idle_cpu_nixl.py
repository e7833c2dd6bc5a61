"""An idle `kvstage prefill` (real NIXL agent) sleeps: its CPU time over a few idle
seconds, read from /proc/PID/stat, is far below a core. nixl-cu12 1.5.1's progress thread
busy-polls (``pthrDelay = 0``), so with it the same process burns a whole core; the
prefill role runs its agent without it (`make_prefill`) and drives UCX from its loop."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = [
    pytest.mark.nixl,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

IDLE_S = 3.0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.timeout(180)
@pytest.mark.xfail(strict=True, reason=(
    "the progress thread is back on by default: without it the CLI prefill died with "
    "SIGSEGV after a SIGTERMed decode peer in tests/system/test_netns.py (about half the "
    "runs, 2026-12-03); with it, 5 of 5 runs passed. Idle prefill spins ~98% of a core "
    "until that crash is understood (issue 14)"))
def test_idle_prefill_cli_uses_a_small_share_of_a_core() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstage.cli", "prefill", "--listen", "127.0.0.1:0",
         "--num-blocks", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        line = ""
        while "listening on" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stdout.readline()
        time.sleep(1.0)  # start-up work is over
        before, start = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(IDLE_S)
        share = (cpu_seconds(proc.pid) - before) / (time.monotonic() - start)
        # a spinning progress thread costs ~1.0; the target (<= 0.05) is in BENCHMARKS.md
        print(f"idle share {share:.3f}")
        assert share < 0.5, f"idle prefill used {share:.0%} of a core"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
