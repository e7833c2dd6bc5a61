"""A process's CPU time from /proc (Linux): how busy an idle role or engine really is."""

from __future__ import annotations

import os
import time

__all__ = ["cpu_seconds", "idle_share"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces and ")"
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def idle_share(pid: int, seconds: float) -> float:
    """CPU used by ``pid`` over the next ``seconds`` of wall time, in cores (1.0 = one
    core busy all the time). The caller makes sure the process is idle meanwhile."""
    before, start = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - start)
