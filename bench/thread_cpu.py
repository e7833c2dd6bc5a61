"""Every thread of a plain server and a kvstage consumer, idle and serving.

    .venv-vllm/bin/python -m bench.thread_cpu

Both servers (`bench.step_cost` kinds, ``--kinds``) on the last core, this client on the
others; after two warm-up requests each: an idle window (``--idle-s``), ``--requests``
streamed requests to each server (alternating, 1.5 s apart: 100 random ids, 64 tokens),
another idle window. For every window, every thread of each server's process group (its
api_server and engine core processes), summed by thread name with digits dropped: CPU
seconds (utime + stime) and voluntary context switches, from ``/proc``. One line each:
``window | server | thread | CPU s | switches``. Tells what a server's threads do when it
serves nothing (a thread that wakes) from what they do per request. Logs under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench.step_cost import KINDS, group_pids, start_servers
from bench.stream import client_off, first_and_gaps
from kvstage.serving import served_model
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE
from kvstage.testing.tiny_llama import build_tiny_llama

TICK = os.sysconf("SC_CLK_TCK")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def sample(pids: list[int]) -> tuple[dict[str, float], Counter[str]]:
    """CPU seconds and voluntary switches so far, summed by thread name (digits dropped)."""
    cpu: dict[str, float] = {}
    switches: Counter[str] = Counter()
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                stat = read(f"/proc/{pid}/task/{tid}/stat")
                status = read(f"/proc/{pid}/task/{tid}/status")
            except OSError:
                continue
            name = re.sub(r"\d+", "N", stat[stat.index("(") + 1:stat.rindex(")")])
            fields = stat.rsplit(")", 1)[1].split()
            cpu[name] = cpu.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
            switches[name] += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return cpu, switches


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="plain,kvstage-consumer",
                   help=f"comma-separated server kinds, from {','.join(KINDS)}")
    p.add_argument("--requests", type=int, default=20, help="per server")
    p.add_argument("--idle-s", type=float, default=20.0)
    p.add_argument("--out", default="/tmp/thread-cpu", help="model and logs")
    a = p.parse_args(argv)
    a.kinds = tuple(k for k in a.kinds.split(",") if k)
    if not a.kinds or any(k not in KINDS for k in a.kinds):
        p.error(f"--kinds: expected names from {','.join(KINDS)}, got {','.join(a.kinds)!r}")
    if a.requests < 1 or not 0 < a.idle_s <= 600:
        p.error(f"--requests must be >= 1 and --idle-s in (0, 600]; got {a.requests}, "
                f"{a.idle_s}")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds, work = args.kinds, Path(args.out)
    model = str(build_tiny_llama(work / "model"))
    core = max(os.sched_getaffinity(0))
    servers = start_servers(kinds, model, core, work / "logs", {})
    client_off(core)
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
        pids = [group_pids(s.pid) for s in servers]
        idle = f"idle {args.idle_s:g} s"
        for phase in (idle, f"serving {args.requests} requests each", idle):
            before = [sample(p) for p in pids]
            if phase == idle:
                time.sleep(args.idle_s)
            else:
                for _ in range(args.requests):
                    for s in servers:
                        time.sleep(1.5)
                        request(s.url)
            after = [sample(p) for p in pids]
            for kind, (c0, w0), (c1, w1) in zip(kinds, before, after, strict=True):
                for thread in sorted(c1, key=lambda t: -(c1[t] - c0[t])):
                    cpu, sw = c1[thread] - c0.get(thread, 0.0), w1[thread] - w0[thread]
                    if cpu or sw:
                        print(f"{phase} | {kind} | {thread} | CPU {cpu:.2f} s | "
                              f"switches {sw}", flush=True)
    finally:
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
