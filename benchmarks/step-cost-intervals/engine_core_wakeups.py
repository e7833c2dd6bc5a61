"""The engine core's main thread, plain server vs kvstage consumer: CPU and voluntary
context switches over an idle 20 s, 20 requests to each (alternating, 1.5 s apart), and
another idle 20 s. Both servers on the last core, this client on core 0. One-off for
BENCHMARKS "Intervals on the A/B":

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/step-cost-intervals/engine_core_wakeups.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from bench.step_cost import start_servers
from bench.stream import first_and_gaps
from kvstage.serving import served_model
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE
from kvstage.testing.tiny_llama import build_tiny_llama

TICK = os.sysconf("SC_CLK_TCK")
KINDS = ("plain", "kvstage-consumer")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def engine_core(pgid: int) -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = read(f"/proc/{pid}/stat")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid and "EngineCor" in stat:
            return int(pid)
    raise RuntimeError(f"no engine core in process group {pgid}")


def sample(pid: int) -> tuple[float, int]:
    """(CPU seconds, voluntary context switches) of ``pid``'s main thread so far."""
    stat = read(f"/proc/{pid}/task/{pid}/stat").rsplit(")", 1)[1].split()
    status = read(f"/proc/{pid}/task/{pid}/status")
    switches = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return (int(stat[11]) + int(stat[12])) / TICK, switches


def main() -> None:
    work = Path("/tmp/wake")
    model = str(build_tiny_llama(work / "model"))
    servers = start_servers(KINDS, model, max(os.sched_getaffinity(0)), work / "logs", {})
    os.sched_setaffinity(0, {0})
    rng = np.random.default_rng(0)
    try:
        name = served_model(servers[0].url)

        def request(url: str) -> None:
            prompt = rng.integers(4, VOCAB_SIZE, size=100).tolist()
            first_and_gaps(url, {"model": name, "prompt": prompt, "max_tokens": 64,
                                 "temperature": 0.0, "ignore_eos": True})

        for s in servers:
            request(s.url)
            request(s.url)
        time.sleep(2)
        pids = [engine_core(s.pid) for s in servers]
        for phase in ("idle 20 s", "serving 20 requests each", "idle 20 s"):
            before = [sample(p) for p in pids]
            if phase.startswith("idle"):
                time.sleep(20)
            else:
                for _ in range(20):
                    for s in servers:
                        time.sleep(1.5)
                        request(s.url)
            after = [sample(p) for p in pids]
            for kind, b, a in zip(KINDS, before, after, strict=True):
                print(f"{phase}: {kind} engine core main thread CPU {a[0] - b[0]:.2f} s, "
                      f"voluntary switches {a[1] - b[1]}", flush=True)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
