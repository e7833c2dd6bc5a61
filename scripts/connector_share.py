"""Share of an api_server's busy time spent in the KV connector's code path, by sampling.

    .venv-vllm/bin/python scripts/connector_share.py --kind kvstage-consumer --requests 150

Starts one api_server of ``--kind`` (`bench.step_cost.KINDS`: plain, kvstage-consumer,
kvstage-producer, kvstage-every-step, nixl-consumer; the tiny Llama, pinned to the last
core), sends ``--requests`` streamed plain requests (100 random ids, 64 tokens) one at a
time, and samples its worker and engine-core processes with py-spy (``--rate`` Hz,
non-blocking; py-spy must be on PATH: ``pip install py-spy``). A sample is BUSY unless it
sits in vLLM's idle waits (the worker's shared-memory dequeue and its ``sched_yield``
spin, the engine's input-queue wait); it is the CONNECTOR'S when, walking from the sampled
frame towards the root, the first frame that is connector code (vLLM's ``kv_transfer``
package, kvstage's connector, vLLM's connector mixin and per-layer wrapper, NIXL) comes
before any model frame. Prints per process the busy samples, the connector's, their
ratio and the top connector frames. Tooling: nothing in the runtime package uses it.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step_cost import KINDS, start_servers  # noqa: E402
from bench.stream import first_and_gaps  # noqa: E402

CONNECTOR = ("kv_connector", "kvstage/integrations", "kv_transfer", "maybe_transfer_kv_layer",
             "nixl")
MODEL = ("model_executor", "Attention", "attention", "torch/nn", "_ops.py", "layers/",
         ".forward (")
IDLE = ("MessageQueue.acquire_read", "MessageQueue.dequeue", "sched_yield", "SpinCondition",
        "_process_input_queue", "Queue.get", "recv_multipart")


def share(raw: Path) -> tuple[int, int, collections.Counter[str]]:
    """(busy samples, the connector's, its top frames) of one py-spy ``--format raw`` file."""
    busy = mine = 0
    top: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or any(m in stack for m in IDLE):
            continue
        n = int(count)
        busy += n
        for frame in reversed(stack.split(";")):
            if any(m in frame for m in CONNECTOR):
                mine += n
                top[frame.split(" (")[0]] += n
                break
            if any(m in frame for m in MODEL):
                break
    return busy, mine, top


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="kvstage-consumer", choices=sorted(KINDS))
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rate", type=int, default=1000)
    a = p.parse_args(argv)
    if not 1 <= a.requests <= 2000 or not 10 <= a.rate <= 5000:
        p.error(f"--requests in [1, 2000], --rate in [10, 5000]; got {a.requests}, {a.rate}")
    spy = shutil.which("py-spy")
    if spy is None:
        p.error("py-spy is not on PATH: pip install py-spy")
    from kvstage.serving import served_model
    from kvstage.testing.tiny_gemma3 import VOCAB_SIZE
    from kvstage.testing.tiny_llama import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="connector-share-"))
    model = str(build_tiny_llama(work / "model"))
    [server] = start_servers((a.kind,), model, max(os.sched_getaffinity(0)), work / "logs", {})
    rng = np.random.default_rng(0)
    try:
        name = served_model(server.url)

        def request() -> None:
            first_and_gaps(server.url, {
                "model": name, "prompt": rng.integers(4, VOCAB_SIZE, size=100).tolist(),
                "max_tokens": 64, "temperature": 0.0, "ignore_eos": True})

        for _ in range(3):
            request()
        ps = subprocess.run(["ps", "-o", "pid=,comm=", "-g", str(server.pid)],
                            capture_output=True, text=True, timeout=10).stdout
        procs = [(int(pid), comm) for pid, comm in (line.split(None, 1) for line in
                 ps.splitlines()) if "Worker" in comm or "EngineCor" in comm]
        spies = [(comm, work / f"{pid}.txt", subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--rate", str(a.rate), "--nonblocking",
             "--format", "raw", "-o", str(work / f"{pid}.txt"), "--duration", "600"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)) for pid, comm in procs]
        time.sleep(2)
        for _ in range(a.requests):
            request()
        for *_, proc in spies:
            proc.send_signal(2)  # py-spy writes its file on SIGINT
        for *_, proc in spies:
            proc.wait(60)
    finally:
        server.stop()
    for comm, raw, _ in spies:
        busy, mine, top = share(raw)
        print(f"{a.kind} {comm.strip()}: busy {busy}, connector {mine} "
              f"({100 * mine / max(busy, 1):.2f} %); top: "
              + ", ".join(f"{f} {n}" for f, n in top.most_common(4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
