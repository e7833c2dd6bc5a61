"""A prefill's TTFT and the d2h on its critical path, saves by chunk vs once per prompt.

    .venv-vllm/bin/python -m bench.save_by_chunk --out benchmarks/save-by-chunk

Two prefill api_servers (KVStageConnector, ``kv_producer``) of one KV-heavy tiny Llama
(`build_kv_heavy_llama`: 8 layers of 4 KV heads x 128, float32, 32 KiB of KV per token;
little compute per byte, so the copy is as large a share of a step as a tiny model allows)
run side by side on ``--core`` (default the last; the client runs on the others): one
with ``kvstage_save_by_chunk`` true (each step copies the blocks it completed, the
prompt's last step only its own chunk's), one with it false (the whole prompt copied in
its last step). Prompts of ``--chunks`` x ``--chunk-tokens`` - 1 tokens
(``max_num_batched_tokens`` is the chunk), random ids, one request in flight, the two
servers alternated and the order rotated each round, each request ``--settle-s`` after the
last one ended (`bench.stream`), ``--rounds`` rounds per prompt length after one warm-up
each. Each request is a P/D prefill (``max_tokens: 1``,
``do_remote_decode``): its latency is the prefill's TTFT; nobody READs, so each prompt is
held for ``--lease`` seconds and the pool holds ``--pool-prompts`` of the longest. Per
server and length, from the client and the server's ``/metrics`` (deltas over the length's
rounds, flushed by one plain request): median TTFT and its range, and per request the d2h
blocks, the blocks its last step copied, the seconds that step waited for its d2h
(``vllm:kvstage_d2h_wait_seconds``) and the copies' own seconds. Writes
``<out>/save_by_chunk.json`` and ``.md``; logs under ``<out>/logs``. Bad arguments: one
line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.stream import add_settle, begin, client_off, post, write_results
from kvstage.serving import metric_total, served_model
from kvstage.serving.cluster import api_server_instance, connector_config, free_ports
from kvstage.serving.engine_args import EngineArgs
from kvstage.serving.instances import Instance
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, save_tiny_model, shared_config_kwargs
from kvstage.testing.vllm_engines import PREFILL_REQUEST_PARAMS

SERVERS = {"by-chunk": True, "once": False}  # name -> kvstage_save_by_chunk
LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 128
KV_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
METRICS = ("vllm:kvstage_d2h_blocks_total", "vllm:kvstage_d2h_last_step_blocks_total",
           "vllm:kvstage_d2h_wait_seconds_total", "vllm:kvstage_d2h_time_seconds_sum",
           "vllm:kvstage_d2h_time_seconds_count")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/save-by-chunk")
    p.add_argument("--chunks", default="1,8,32", help="prompt lengths in chunks, e.g. 1,8,32")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    add_settle(p)
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)),
                   help="the core both servers run on (the client runs on the others)")
    p.add_argument("--lease", type=int, default=2,
                   help="kv_lease_duration (s): how long nobody's READ holds each prompt")
    p.add_argument("--pool-prompts", type=int, default=12,
                   help="KV pool size, in prompts of the longest length")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        a.chunks = [int(c) for c in a.chunks.split(",") if c]
    except ValueError:
        p.error(f"--chunks: comma-separated integers, got {a.chunks!r}")
    if not a.chunks or any(not 1 <= c <= 64 for c in a.chunks):
        p.error(f"--chunks: numbers in [1, 64], got {a.chunks}")
    if not 32 <= a.chunk_tokens <= 512 or a.chunk_tokens % 32:
        p.error(f"--chunk-tokens: a multiple of 32 (the block size) in [32, 512], got "
                f"{a.chunk_tokens}")
    if a.rounds < 1 or not 1 <= a.lease <= 600 or not 2 <= a.pool_prompts <= 64:
        p.error(f"--rounds >= 1, --lease in [1, 600], --pool-prompts in [2, 64]; got "
                f"{a.rounds}, {a.lease}, {a.pool_prompts}")
    if a.core not in os.sched_getaffinity(0):
        p.error(f"--core {a.core}: expected a core this process may use "
                f"({sorted(os.sched_getaffinity(0))})")
    return a


def build_kv_heavy_llama(path: Path) -> Path:
    """The tiny Llama's vocabulary and tokenizer with more KV per token than compute."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = {**shared_config_kwargs(), "num_hidden_layers": LAYERS, "num_attention_heads": KV_HEADS,
          "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "max_position_embeddings": 64 * 512 + 64}
    return save_tiny_model(LlamaForCausalLM, LlamaConfig(**kw, tie_word_embeddings=True),
                           path, seed=0)


def start(model: str, args: argparse.Namespace, logs: Path) -> list[Instance]:
    longest = max(args.chunks) * args.chunk_tokens
    # nobody READs: each prompt is held for the lease (--lease), the pool sized to match
    engine = EngineArgs(dtype="float32", max_model_len=longest + 32,
                        max_num_batched_tokens=args.chunk_tokens, max_num_seqs=4,
                        block_size=32,
                        kv_cache_memory_bytes=args.pool_prompts * longest * KV_PER_TOKEN,
                        enforce_eager=True, enable_prefix_caching=False, seed=0)
    ports = free_ports(2 * len(SERVERS))
    servers = []
    for i, (name, by_chunk) in enumerate(SERVERS.items()):
        kv = connector_config("kvstage", "kv_producer", device="cpu", policy="fail", extra={
            "kvstage_save_by_chunk": by_chunk, "kv_lease_duration": args.lease})
        servers.append(api_server_instance(
            name, "prefill", model, port=ports[i], log_dir=logs, engine_args=engine,
            kv_config=kv, device="cpu", cores=(args.core,),
            side_channel_port=ports[len(SERVERS) + i]))
    for s in servers:
        s.spawn()
    for s in servers:
        s.wait_ready(600.0)
    return servers


def prefill(url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": dict(PREFILL_REQUEST_PARAMS)}
    start = time.perf_counter()
    resp = post(url, body)
    reply = json.loads(resp.read(1 << 20))
    if "kv_transfer_params" not in reply:
        raise RuntimeError(f"{url}: a prefill reply without kv_transfer_params: {reply}")
    return time.perf_counter() - start


def figures(url: str) -> dict[str, float]:
    return {m: metric_total(url, m) for m in METRICS}


def measure(servers: list[Instance], n_chunks: int, args: argparse.Namespace,
            rng: np.random.Generator) -> dict[str, dict[str, Any]]:
    model = served_model(servers[0].url)
    tokens = n_chunks * args.chunk_tokens - 1  # the last chunk one short of full

    def prompt() -> list[int]:
        return rng.integers(4, VOCAB_SIZE, size=tokens).tolist()

    for s in servers:
        prefill(s.url + "/v1/completions", model, prompt())  # warm-up
    flush(servers, model)
    before = [figures(s.url) for s in servers]
    ttft: list[list[float]] = [[] for _ in servers]
    for r in range(args.rounds):
        for k in range(len(servers)):
            i = (k + r) % len(servers)
            time.sleep(args.settle_s)
            ttft[i].append(prefill(servers[i].url + "/v1/completions", model, prompt()))
    flush(servers, model)
    out = {}
    for i, s in enumerate(servers):
        after = figures(s.url)
        d = {m: after[m] - before[i][m] for m in METRICS}
        n = d["vllm:kvstage_d2h_time_seconds_count"]
        assert n == args.rounds, f"{s.name}: {n} d2h records for {args.rounds} requests"
        out[s.name] = {
            "ttft_ms": 1e3 * float(np.median(ttft[i])),
            "ttft_ms_each": [round(1e3 * t, 2) for t in ttft[i]],
            "d2h_blocks": d["vllm:kvstage_d2h_blocks_total"] / n,
            "last_step_blocks": d["vllm:kvstage_d2h_last_step_blocks_total"] / n,
            "wait_ms": 1e3 * d["vllm:kvstage_d2h_wait_seconds_total"] / n,
            "copy_ms": 1e3 * d["vllm:kvstage_d2h_time_seconds_sum"] / n,
        }
    return out


def flush(servers: list[Instance], model: str) -> None:
    """A plain request per server, then a pause: the last step's figures reach /metrics
    with the engine's next outputs (vLLM sends a step's stats with them)."""
    for s in servers:
        post(s.url + "/v1/completions", {"model": model, "prompt": [5, 6], "max_tokens": 2}
             ).read()
    time.sleep(1.5)


def table(results: dict[int, dict[str, dict[str, Any]]], chunk_tokens: int) -> str:
    lines = ["| prompt | server | TTFT ms (median) | x once | TTFT range ms | d2h blocks | "
             "last-step blocks | last-step d2h wait ms | d2h copy ms |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for n, rows in results.items():
        once = rows["once"]["ttft_ms"]
        for name, r in rows.items():
            each = r["ttft_ms_each"]
            lines.append(f"| {n} x {chunk_tokens} - 1 | {name} | {r['ttft_ms']:.1f} | "
                         f"{r['ttft_ms'] / once:.3f} | {min(each):.0f}-{max(each):.0f} | "
                         f"{r['d2h_blocks']:.0f} | "
                         f"{r['last_step_blocks']:.0f} | {r['wait_ms']:.2f} | "
                         f"{r['copy_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, model, rng, started = begin(args, build_kv_heavy_llama, "kv-heavy-llama")
    client_off(args.core)
    servers = start(model, args, out / "logs")
    try:
        results = {n: measure(servers, n, args, rng) for n in args.chunks}
    finally:
        for s in servers:
            s.stop()
    text = table(results, args.chunk_tokens)
    print(text, flush=True)
    write_results(out, "save_by_chunk", text, args, started, {"results": results},
                  kv_bytes_per_token=KV_PER_TOKEN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
