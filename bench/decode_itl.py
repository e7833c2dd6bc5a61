"""A P/D decode's inter-token latency against a plain instance's, on the same core.

    .venv-vllm/bin/python -m bench.decode_itl --out benchmarks/decode-itl

A 1P1D kvstage deployment of the tiny Llama (`kvstage.serving.PDCluster`,
`TINY_CPU_ENGINE_ARGS`, vllm-router; on 2 cores the prefill gets the first, the decode the
last) and a plain api_server (no connector) pinned to the decode's core. ``--rounds``
rounds of one streamed request per path (``--input-len`` random ids, ``--output-len``
tokens, ``ignore_eos``), one in flight, each ``--settle-s`` after the last one ended
(`bench.stream`: back to back, ``pd-direct`` mostly followed the decode's own request and
``plain`` the decode's, which favoured the P/D paths), the order rotated each round, after
two warm-ups each, over three paths: ``pd-router`` (the router: prefill, READ, then the decode's
tokens through the router), ``pd-direct`` (vLLM's proxy protocol done by this client: the
prefill request, then the decode streamed directly: the decode's own ITL, no router hop)
and ``plain``. Per path: mean and median ITL (the gaps between streamed tokens after the
first: each a decode step of the decode instance, or of the plain one) and TTFT, and the
ratios to the plain server's. ``--kv-extra KEY=VALUE`` (repeatable) goes to the P/D
instances' ``kv_connector_extra_config`` (e.g. ``kvstage_progress_delay_us=1000``: the
NIXL progress thread's idle wait). The two decoding processes share one core,
so the box's load falls on both. Writes ``<out>/decode_itl.json`` and ``.md``; logs under
``<out>/logs``. Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

from bench.stream import (
    add_kv_extra,
    add_settle,
    begin,
    first_and_gaps,
    kv_extra,
    post,
    write_results,
)
from kvstage.serving import TINY_CPU_ENGINE_ARGS, PDCluster, served_model, single_instance
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE  # the tiny Llama shares its tokenizer
from kvstage.testing.vllm_engines import PREFILL_REQUEST_PARAMS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/decode-itl")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=64)
    add_settle(p)
    add_kv_extra(p)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.rounds < 1 or not 1 <= a.input_len <= 400 or not 2 <= a.output_len <= 100:
        p.error(f"--rounds >= 1, --input-len in [1, 400], --output-len in [2, 100]; got "
                f"{a.rounds}, {a.input_len}, {a.output_len}")
    a.extra = kv_extra(p, a)
    if len(os.sched_getaffinity(0)) < 2:
        p.error("needs 2 cores: the prefill on one, the decode and the plain server on another")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, model, rng, started = begin(args)
    with PDCluster(model=model, connector="kvstage", log_dir=out / "logs",
                   engine_args=TINY_CPU_ENGINE_ARGS, start_timeout=600.0,
                   extra_kv_config=args.extra or None) as c:
        decode_cores = c.decodes[0].cores
        with single_instance(model, log_dir=out / "logs", engine_args=TINY_CPU_ENGINE_ARGS,
                             device="cpu", cores=decode_cores, start_timeout=600.0) as plain:
            name = served_model(plain.url)
            urls = {"pd-router": c.router_url, "pd-direct": c.prefills[0].url,
                    "plain": plain.url}
            decode_url = c.decodes[0].url

            def request(url: str) -> tuple[float, list[float]]:
                body: dict[str, Any] = {
                    "model": name, "temperature": 0.0, "ignore_eos": True,
                    "max_tokens": args.output_len,
                    "prompt": rng.integers(4, VOCAB_SIZE, size=args.input_len).tolist()}
                start = time.perf_counter()
                if url == c.prefills[0].url:  # vLLM's proxy protocol, done by this client
                    resp = post(url, {**body, "max_tokens": 1,
                                      "kv_transfer_params": PREFILL_REQUEST_PARAMS})
                    params = json.loads(resp.read(1 << 20))["kv_transfer_params"]
                    url, body = decode_url, {**body, "kv_transfer_params": params}
                return first_and_gaps(url, body, start)

            for url in urls.values():
                for _ in range(2):
                    request(url)
            got: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "itl": []} for k in urls}
            order = list(urls)
            for r in range(args.rounds):
                for k in order[r % 3:] + order[:r % 3]:
                    time.sleep(args.settle_s)
                    first, gaps = request(urls[k])
                    got[k]["ttft"].append(first)
                    got[k]["itl"].extend(gaps)
    rows: dict[str, dict[str, Any]] = {}
    for k, g in got.items():
        rows[k] = {"ttft_ms": 1e3 * float(np.mean(g["ttft"])),
                   "itl_ms": 1e3 * float(np.mean(g["itl"])),
                   "itl_p50_ms": 1e3 * float(np.median(g["itl"])),
                   "gaps": len(g["itl"])}
    for row in rows.values():
        row["itl_x"] = row["itl_ms"] / rows["plain"]["itl_ms"]
        row["ttft_x"] = row["ttft_ms"] / rows["plain"]["ttft_ms"]
    lines = ["| path | TTFT ms | x plain | ITL ms (mean) | x plain | ITL ms (median) | gaps |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for k, row in rows.items():
        lines.append(f"| {k} | {row['ttft_ms']:.1f} | {row['ttft_x']:.3f} | "
                     f"{row['itl_ms']:.2f} | {row['itl_x']:.3f} | {row['itl_p50_ms']:.2f} | "
                     f"{row['gaps']} |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    write_results(out, "decode_itl", text, args, started, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
