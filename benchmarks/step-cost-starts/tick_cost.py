"""What one shipment of kvstage's once-a-second stats tick costs, warm, in one process: the
worker's and the scheduler's `KVStageStats` with their quiet-step counts, the worker's
pickled to the engine core, the two merged and sent on as vLLM's msgpack to the API server,
which observes them into Prometheus and rebuilds them for its logger. In a server the steps
are split over three processes and run on caches the forward cooled. One-off for
BENCHMARKS "Idle connector steps"; run from the checkout's root:

    PYTHONPATH=src:. taskset -c 1 .venv-vllm/bin/python benchmarks/step-cost-starts/tick_cost.py
"""

from __future__ import annotations

import functools
import pickle
import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvstage.integrations.vllm.quiet import QUIET_KEY
from kvstage.integrations.vllm.stats import KVStagePromMetrics, KVStageStats

REG = CollectorRegistry()
TYPES = {t: functools.partial(t, registry=REG) for t in (Gauge, Counter, Histogram)}
PROM = KVStagePromMetrics(SimpleNamespace(kv_transfer_config=None), TYPES,
                          ["model_name", "engine"], {0: ["m", "0"]})
ENC, DEC = MsgpackEncoder(), MsgpackDecoder(dict)


def ship() -> None:
    worker = KVStageStats()
    worker.data.update({QUIET_KEY: [["worker", 40]]})
    worker = pickle.loads(pickle.dumps(worker))  # worker process -> engine core
    scheduler = KVStageStats()
    scheduler.data.update({QUIET_KEY: [["scheduler", 40]]})
    sent = DEC.decode(ENC.encode(worker.aggregate(scheduler).to_dict()))  # -> API server
    PROM.observe(sent, 0)
    KVStageStats(data=sent)  # vLLM's logging stat logger rebuilds it


def main() -> None:
    for _ in range(200):
        ship()
    for _ in range(3):
        n, start = 2000, time.perf_counter()
        for _ in range(n):
            ship()
        print(f"one tick shipment, warm: {(time.perf_counter() - start) / n * 1e6:.1f} us")


if __name__ == "__main__":
    main()
