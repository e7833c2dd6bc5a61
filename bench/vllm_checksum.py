"""Cost of the connector's opt-in checksum (``kvstage_verify_checksum``, issue 20 item 5).

Two measurements:

- ``--micro``: what the checksum adds per request on each side, against the copy it
  follows: ``block_digests`` of the host buffer over a request's ids (what the prefill
  does after its d2h and the decode before its h2d, `kvstage.pd.integrity`: one xxh3 per
  block-major row) vs the connector's d2h of the same ids (``PrefillWorker.save``'s copy:
  `bench.vllm_connector.connector_copy`). gemma-3-1b's shapes laid out as vLLM 0.32.0
  allocates them (`bench.vllm_connector.vllm_device_caches`), wrapped and given the
  block-major host buffer as the connector does (`bench.vllm_connector.connector_engine`);
  ids 1..n, in the full-attention group. Steps in random order per round, medians.
- ``--engines``: real engines, two P/D pairs of the tiny hybrid Gemma3 (KVStageConnector,
  checksum off / on, 4 engines, 2 cores), requests interleaved off, on, off, on...: the
  prefill's and the decode's ``LLM.generate`` wall time for one prompt (measured in the
  engine child), medians over the rounds.

    .venv-vllm/bin/python -m bench.vllm_checksum --micro --iters 300
    .venv-vllm/bin/python -m bench.vllm_checksum --engines --rounds 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.vllm_connector import GEMMA3_1B, connector_copy, connector_engine, vllm_device_caches
from kvstage.pd.integrity import block_digests


def micro(iters: int, counts: list[int]) -> None:
    device = vllm_device_caches(GEMMA3_1B, 80)
    engine = connector_engine(GEMMA3_1B, device)
    others: list[list[int]] = [[] for _ in range(engine.layout.num_groups - 1)]
    print("| ids | MiB | d2h copy us | digest us | digest / copy | digest GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in counts:
        ids = list(range(1, n + 1))
        steps = {
            "copy": lambda ids=ids: connector_copy(engine, [ids, *others], "d2h"),
            "digest": lambda ids=ids: block_digests(engine.host, ids),
        }
        samples: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(iters):
            for name in random.sample(list(steps), len(steps)):
                t0 = time.perf_counter()
                steps[name]()
                samples[name].append((time.perf_counter() - t0) * 1e6)
        nbytes = n * engine.layout.block_bytes
        c, d = (statistics.median(samples[k]) for k in ("copy", "digest"))
        print(f"| {n} | {nbytes / 2**20:.2f} | {c:.1f} | {d:.1f} | {d / c:.2f} | "
              f"{nbytes / d / 1e3:.2f} |")


def engines(rounds: int, prompt_len: int, max_tokens: int) -> None:
    import numpy as np

    from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3
    from kvstage.testing.vllm_engines import (
        KVSTAGE_CONNECTOR,
        EngineSpec,
        VLLMEngine,
        free_ports,
        kv_transfer_config,
        side_channel_env,
    )
    from kvstage.testing.vllm_pd import generate_pd

    tmp = Path(tempfile.mkdtemp(prefix="bench-checksum-"))
    model = build_tiny_gemma3(tmp / "model")
    ports = free_ports(4)

    def spec(name: str, core: int, role: str, port: int, verify: bool) -> EngineSpec:
        return EngineSpec(
            model=str(model), log_path=str(tmp / f"{name}.log"), block_size=32,
            cpu_core=core, env=side_channel_env(port),
            kv_transfer_config=kv_transfer_config(
                KVSTAGE_CONNECTOR, role, kvstage_verify_checksum=verify),
        )

    pairs = {
        verify: (VLLMEngine(spec(f"p{int(verify)}", 0, "kv_producer", ports[2 * verify], verify)),
                 VLLMEngine(spec(f"d{int(verify)}", 1, "kv_consumer", ports[2 * verify + 1],
                                 verify)))
        for verify in (False, True)
    }
    rng = np.random.default_rng(7)
    try:
        for p, d in pairs.values():
            p.start()
            d.start()
        times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        tokens: dict[bool, list[list[int]]] = {False: [], True: []}
        for r in range(rounds + 1):  # round 0 warms up (handshake)
            prompt = rng.integers(3, VOCAB_SIZE, size=prompt_len).tolist()
            for verify in (False, True) if r % 2 else (True, False):
                p, d = pairs[verify]
                got = generate_pd(p, d, [prompt], max_tokens=max_tokens, logprobs=0)
                tokens[verify].append(got[0].token_ids)
                if r:
                    times[verify].append((p.last_generate_s, d.last_generate_s))
        assert tokens[False] == tokens[True], "checksum on changed the tokens"
        print(f"prompt {prompt_len} tokens, {max_tokens} output tokens, {rounds} rounds, "
              f"torch threads {torch.get_num_threads()}; tokens identical on/off")
        print("| checksum | prefill ms | decode ms | P/D ms |")
        print("|---|---:|---:|---:|")
        for verify in (False, True):
            ps = [a * 1e3 for a, _ in times[verify]]
            ds = [b * 1e3 for _, b in times[verify]]
            tot = [a + b for a, b in zip(ps, ds, strict=True)]
            print(f"| {'on' if verify else 'off'} | {statistics.median(ps):.1f} | "
                  f"{statistics.median(ds):.1f} | {statistics.median(tot):.1f} |")
    finally:
        for p, d in pairs.values():
            p.stop()
            d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--engines", action="store_true")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--ids", type=int, nargs="+", default=[9, 64])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.micro:
        micro(args.iters, args.ids)
    if args.engines:
        engines(args.rounds, args.prompt_tokens, args.max_tokens)
    if not (args.micro or args.engines):
        ap.error("choose --micro and/or --engines")


if __name__ == "__main__":
    main()
