"""`python -m bench.serving_netns`: TTFT of long prompts served across two "hosts", and the
READ's share of it (root, vLLM: run it with .venv-vllm's Python).

The deployment of `tests/system/vllm/test_serving_netns.py`: two network namespaces joined
by a veth pair (`bench.netns.Pair`), ``kvstage serve-pd --role prefill`` in one (its own
core), ``--role decode`` and ``--role router`` in the other (the other core), one key file,
UCX on TCP over the veth. The model is a KV-heavy tiny Llama (full attention only, so the
READ moves the whole prompt's KV): ``--kv-heads`` KV heads of 64, ``--layers`` layers,
float32, ``(layers x 2 x kv_heads x 64 x 4)`` bytes of KV per token (16 KiB by default: a
3000-token prompt moves 47 MiB).

Per variant and round, a client in the decode namespace sends ``--prompts`` prompts of
random token ids (lengths drawn in ``--lens MIN-MAX`` from ``--seed``; ``--max-tokens``
greedy tokens each) through the router, streamed: first one at a time, then all with
``--concurrency`` in flight. TTFT is the client's (request sent -> first token chunk). READ
seconds and bytes come from the decode's ``/metrics`` (``vllm:kvstage_read_time_seconds``,
posted to last chunk DONE, and ``vllm:kvstage_read_bytes``): one at a time, per request
(the counters' deltas around it); in flight, summed over the phase. The READ's share of
TTFT is READ seconds summed / client TTFT summed, per phase. Every completion's token ids
must equal a plain api_server's on 127.0.0.1 (run once, first); the table counts them.

``--variant NAME:KEY=VALUE,...`` (`bench.tcp_link`'s syntax; repeatable) adds variables to
both hosts' environments; UCX variables there win over kvstage's own choice, so UCX's
defaults are ``before:UCX_TCP_TX_SEG_SIZE=8k,UCX_TCP_RX_SEG_SIZE=64k``. Variants alternate
within each of ``--rounds`` rounds, each on fresh namespaces and instances.

Bounds: every instance start (`START_S` of the test), the client (``--client-timeout``,
each HTTP call `bench.stream.TIMEOUT_S`), the reference. Namespaces and every process are
removed at the end, failed or not (SIGTERM included). Writes ``--json``; prints a markdown
table. Exit 1 if a variant failed or a completion differed. The pure parts (`parse_lens`,
`engine_args`, `make_prompts`, `summarize`, `format_summary`) import nothing from vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import netns
from bench.tcp_link import _variant
from kvstage.bench.report import Column, format_table, machine_info, write_json
from kvstage.serving import TINY_CPU_ENGINE_ARGS, EngineArgs, metric_total
from kvstage.testing.tiny_gemma3 import HEAD_DIM, VOCAB_SIZE

PREFILL_PORT, DECODE_PORT, ROUTER_PORT = 8100, 8200, 8000
BLOCK_TOKENS = 32  # vLLM's CPU block size for these models (TINY_CPU_ENGINE_ARGS)
BATCHED_TOKENS = 2048  # per step: a 4000-token prompt in 2 prefill steps, not 34 of 120
SETTLE_S = 15.0  # bound on the wait for a READ's figures to reach /metrics
TEST_MODULE = "tests.system.vllm.test_serving_netns"  # its helpers import vLLM: lazily
DECODE_METRICS = {"read_s": "vllm:kvstage_read_time_seconds_sum",
                  "reads": "vllm:kvstage_read_time_seconds_count",
                  "read_bytes": "vllm:kvstage_read_bytes_total",
                  "h2d_s": "vllm:kvstage_h2d_time_seconds_sum"}
PREFILL_METRICS = {"d2h_wait_s": "vllm:kvstage_d2h_wait_seconds_total"}


def parse_lens(text: str) -> tuple[int, int]:
    """``MIN-MAX`` prompt lengths in tokens (``3000`` alone: MIN = MAX)."""
    lo, _, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(
            f"--lens {text!r}: expected MIN-MAX prompt tokens with 1 <= MIN <= MAX, e.g. "
            "2000-4000")
    return a, b


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--prompts", type=int, default=8, help="prompts per phase (default 8)")
    a("--lens", type=parse_lens, default=(2000, 4000), metavar="MIN-MAX",
      help="prompt lengths in tokens (default 2000-4000)")
    a("--max-tokens", type=int, default=4)
    a("--concurrency", type=int, default=4, help="in flight in the second phase")
    a("--kv-heads", type=int, default=8, help="KV heads of 64 (= query heads)")
    a("--layers", type=int, default=4)
    a("--seed", type=int, default=37)
    a("--variant", type=_variant, action="append", default=None,
      help="NAME:KEY=VALUE,... extra environment of both hosts (repeatable; default one "
      "variant, 'default': kvstage's own choice)")
    a("--rounds", type=int, default=1, help="alternations of the variants")
    a("--client-timeout", type=float, default=600.0, help="bound on one variant's client")
    a("--work", default=None, help="directory for the model and logs (default: a temp dir)")
    a("--json", default=None, metavar="PATH")
    a("--client", default=None, help=argparse.SUPPRESS)  # internal: the in-namespace client


def check(args: argparse.Namespace) -> None:
    if args.prompts < 1 or args.max_tokens < 1 or args.rounds < 1 or args.layers < 1:
        raise argparse.ArgumentTypeError("--prompts, --max-tokens, --rounds and --layers "
                                         "must be >= 1")
    if not 1 <= args.concurrency <= args.prompts:
        raise argparse.ArgumentTypeError(f"--concurrency {args.concurrency}: expected 1 to "
                                         f"--prompts ({args.prompts})")
    if args.kv_heads not in (1, 2, 4, 8, 16):
        raise argparse.ArgumentTypeError(f"--kv-heads {args.kv_heads}: expected 1, 2, 4, 8 "
                                         "or 16")


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    return args.layers * 2 * args.kv_heads * HEAD_DIM * 4  # K and V, float32


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The tiny CPU settings with room for the longest prompt and a KV pool that holds
    ``2 x concurrency`` of them (a prefill holds a request's blocks until its READ)."""
    tokens = args.lens[1] + args.max_tokens
    max_len = math.ceil(tokens / BLOCK_TOKENS) * BLOCK_TOKENS
    pool = 2 * args.concurrency * max_len * kv_bytes_per_token(args)
    return replace(TINY_CPU_ENGINE_ARGS, max_model_len=max_len, max_num_seqs=2 * args.concurrency,
                   max_num_batched_tokens=max(BATCHED_TOKENS, BLOCK_TOKENS),
                   kv_cache_memory_bytes=pool)


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.lens[0], args.lens[1] + 1, size=args.prompts)
    return [rng.integers(4, VOCAB_SIZE, size=int(n)).tolist() for n in lens]


def build_model(path: Path, args: argparse.Namespace) -> Path:
    """The tiny Llama of `kvstage.testing.tiny_llama` with ``kv_heads`` query and KV heads,
    ``layers`` layers, positions for ``--lens`` (its builder fixes 2 heads, 1024) and
    weights drawn wider."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstage.testing.tiny_gemma3 import save_tiny_model, shared_config_kwargs

    kwargs = shared_config_kwargs(num_kv_heads=args.kv_heads) | {
        "num_attention_heads": args.kv_heads, "num_hidden_layers": args.layers,
        "max_position_embeddings": max(1024, engine_args(args).max_model_len or 0),
        # at the default 0.02 the output of a random model over thousands of tokens is one
        # token repeated, the same for most prompts (a weak exactness check); at 0.2 it
        # depends on the prompt (greedy from transformers: 4 prompts, 16 tokens, 15 distinct)
        "initializer_range": 0.2}
    return save_tiny_model(LlamaForCausalLM, LlamaConfig(**kwargs, tie_word_embeddings=True),
                           path, seed=0)


# -- the client, in the decode namespace ----------------------------------------------

def stream_one(url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: client TTFT (s), its token ids, or its error."""
    from bench.stream import post

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    ttft: float | None = None
    ids: list[int] = []
    try:
        resp = post(url, body)
        for raw in resp:
            line = raw.strip()
            if line.startswith(b"data: {"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
        resp.close()
    except (OSError, RuntimeError, ValueError, KeyError, IndexError) as exc:
        return {"ttft_s": ttft, "ids": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"ttft_s": ttft, "ids": ids, "error": None if ttft else "no token streamed"}


def counters(spec: dict[str, Any]) -> dict[str, float]:
    return ({k: metric_total(spec["decode"], n) for k, n in DECODE_METRICS.items()}
            | {k: metric_total(spec["prefill"], n) for k, n in PREFILL_METRICS.items()})


def delta_after(spec: dict[str, Any], before: dict[str, float], reads: int) -> dict[str, float]:
    """Counters minus ``before`` once ``reads`` more READs are counted (or `SETTLE_S`)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = counters(spec)
        if now["reads"] - before["reads"] >= reads or time.monotonic() > deadline:
            return {k: now[k] - before[k] for k in now}
        time.sleep(0.2)


def client(spec: dict[str, Any]) -> dict[str, Any]:
    url, prompts, n = spec["router"], spec["prompts"], spec["max_tokens"]
    from kvstage.serving import served_model

    model = served_model(url)
    for _ in range(2):  # the first request through a deployment carries the handshake
        stream_one(url, model, prompts[0][:64], n)
    time.sleep(1.0)
    serial = []
    for prompt in prompts:
        before = counters(spec)
        serial.append(stream_one(url, model, prompt, n) | delta_after(spec, before, 1))
    time.sleep(1.0)
    before, start = counters(spec), time.perf_counter()
    with ThreadPoolExecutor(max_workers=spec["concurrency"]) as pool:
        both = list(pool.map(lambda p: stream_one(url, model, p, n), prompts))
    wall = time.perf_counter() - start
    return {"serial": serial, "concurrent": both, "wall_s": wall,
            "concurrent_metrics": delta_after(spec, before, len(prompts))}


# -- the deployment, per variant -------------------------------------------------------

def run_variant(args: argparse.Namespace, model: str, prompts: list[list[int]],
                env: dict[str, str], work: Path, tag: str) -> dict[str, Any]:
    t = importlib.import_module(TEST_MODULE)  # _key_file, _host_cores, _wait_ready
    pair = netns.Pair(tag=f"{os.getpid() % 100000}{tag}").up()
    try:
        d = work / f"run-{tag}"
        d.mkdir(parents=True, exist_ok=True)
        key = t._key_file(d / "kvstage.key")
        child = {k: v for k, v in netns.child_env(env).items() if k != "KVSTAGE_KEY"}
        common = ["--model", model, "--key-file", str(key), "--device", "cpu"]
        api = ["--engine-defaults", "vllm", "--", *engine_args(args).argv()]

        def serve(ns: str, name: str, *argv: str) -> subprocess.Popen[bytes]:
            cores = t._host_cores(t.P_NS if ns == pair.p else t.D_NS)  # the test's split
            log = str(d / f"{name}.out")
            return pair.popen(ns, [*cores, sys.executable, "-m", "kvstage.cli", "serve-pd",
                                   "--log-dir", str(d / name), *argv], env=child, log=log)

        hosts = {"prefill": serve(pair.p, "prefill", *common, "--role", "prefill", "--host",
                                  netns.PREFILL_IP, "--port", str(PREFILL_PORT), *api),
                 "decode": serve(pair.d, "decode", *common, "--role", "decode", "--host",
                                 netns.DECODE_IP, "--port", str(DECODE_PORT), *api)}
        for name, proc in hosts.items():
            t._wait_ready(proc, d / f"{name}.out")
        urls = {"prefill": f"http://{netns.PREFILL_IP}:{PREFILL_PORT}",
                "decode": f"http://{netns.DECODE_IP}:{DECODE_PORT}",
                "router": f"http://{netns.DECODE_IP}:{ROUTER_PORT}"}
        router = serve(pair.d, "router", "--model", model, "--role", "router", "--host",
                       netns.DECODE_IP, "--port", str(ROUTER_PORT), "--prefill-url",
                       urls["prefill"], "--decode-url", urls["decode"],
                       "--router-arg=--health-check-interval-secs=5")
        t._wait_ready(router, d / "router.out")
        spec = d / "spec.json"
        spec.write_text(json.dumps(urls | {"prompts": prompts, "max_tokens": args.max_tokens,
                                           "concurrency": args.concurrency}))
        proc = pair.popen(pair.d, [sys.executable, "-m", "bench.serving_netns", "--client",
                                   str(spec)], env=netns.child_env(), stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=args.client_timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the client in the decode namespace exited {proc.returncode}")
        doc: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        doc["ucx"] = {name: sorted(set(re.findall(r"UCX_TCP_\w+_SEG_SIZE=\S+", (
            d / f"{name}.out").read_text(errors="replace")))) for name in hosts}
        return doc
    finally:
        pair.close()


# -- the summary -----------------------------------------------------------------------

def _p50_ms(values: list[float]) -> float | None:
    return 1e3 * float(np.median(values)) if values else None


def summarize(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant over its rounds: prompts, mean tokens, KV MiB per request, TTFT
    p50 per phase, READ ms per request and READ seconds / TTFT seconds (both summed) per
    phase, exact / total completions."""
    ref, lens = doc["reference"], [len(p) for p in doc["prompts"]]
    rows = []
    for name in dict.fromkeys(r["variant"] for r in doc["runs"]):
        runs = [r for r in doc["runs"] if r["variant"] == name]
        serial = [q for r in runs for q in r["serial"]]
        both = [q for r in runs for q in r["concurrent"]]
        done = [q for q in serial + both if q["ttft_s"] is not None]
        exact = sum(q["ids"] == ref[i % len(ref)] for r in runs
                    for part in ("serial", "concurrent") for i, q in enumerate(r[part]))
        t1 = sum(q["ttft_s"] for q in serial if q["ttft_s"] is not None)
        t4 = sum(q["ttft_s"] for q in both if q["ttft_s"] is not None)
        r1 = sum(q["read_s"] for q in serial)
        r4 = sum(r["concurrent_metrics"]["read_s"] for r in runs)
        reads4 = sum(r["concurrent_metrics"]["reads"] for r in runs)
        rows.append({
            "variant": name, "rounds": len(runs), "prompts": len(lens),
            "tokens": float(np.mean(lens)),
            "kv_mib": sum(q["read_bytes"] for q in serial) / max(1, len(serial)) / 2**20,
            "ttft1_ms": _p50_ms([q["ttft_s"] for q in serial if q["ttft_s"] is not None]),
            "ttft4_ms": _p50_ms([q["ttft_s"] for q in both if q["ttft_s"] is not None]),
            "read1_ms": 1e3 * r1 / max(1, len(serial)),
            "share1": 100 * r1 / t1 if t1 else None,
            "read4_ms": 1e3 * r4 / reads4 if reads4 else None,
            "share4": 100 * r4 / t4 if t4 else None,
            "exact": exact, "total": len(serial) + len(both), "answered": len(done)})
    return rows


def columns(concurrency: int) -> list[Column]:
    n = concurrency
    return [
        Column("variant", "variant", align="<"), Column("rounds", "rounds"),
        Column("prompts", "prompts"), Column("tokens", "tokens (mean)", "{:.0f}"),
        Column("kv_mib", "KV MiB/request", "{:.1f}"),
        Column("ttft1_ms", "TTFT p50, 1 in flight (ms)", "{:.0f}"),
        Column("ttft4_ms", f"TTFT p50, {n} in flight (ms)", "{:.0f}"),
        Column("read1_ms", "READ ms/request, 1", "{:.1f}"),
        Column("share1", "READ / TTFT, 1", "{:.1f}%"),
        Column("read4_ms", f"READ ms/request, {n}", "{:.1f}"),
        Column("share4", f"READ / TTFT, {n}", "{:.1f}%"),
        Column("exact_text", "exact/total", align="<"),
    ]


def format_summary(doc: dict[str, Any]) -> str:
    """The markdown table of `summarize` (``doc``: the ``--json`` document)."""
    rows = [r | {"exact_text": f"{r['exact']}/{r['total']}"} for r in summarize(doc)]
    return format_table(rows, columns(doc["config"]["concurrency"]), markdown=True)


def run(args: argparse.Namespace) -> int:
    if args.client:  # inside the decode namespace: one JSON line on stdout
        print(json.dumps(client(json.loads(Path(args.client).read_text()))))
        return 0
    check(args)
    why = netns.unavailable()
    if why:
        raise argparse.ArgumentTypeError(f"cannot build namespaces: {why}")
    from kvstage.serving import complete, single_instance
    from kvstage.serving.cluster import router_executable

    router_executable()  # ServingError naming the fix when vllm-router is missing
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # -> finally
    work = Path(args.work or tempfile.mkdtemp(prefix="kvstage-serving-netns-"))
    model = str(build_model(work / "model", args))
    prompts = make_prompts(args)
    with single_instance(model, log_dir=work / "single", engine_args=engine_args(args),
                         start_timeout=420.0) as single:
        ref = [r.token_ids for r in complete(single.url, prompts, args.max_tokens,
                                             concurrency=1, timeout=300.0)]
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")} | {
        "engine_args": engine_args(args).argv(), "kv_bytes_per_token": kv_bytes_per_token(args)}
    doc: dict[str, Any] = {"config": config, "prompts": prompts, "reference": ref, "runs": []}
    failed: list[dict[str, Any]] = []
    variants = args.variant or [("default", {})]
    for rnd in range(args.rounds):
        for i, (name, env) in enumerate(variants):
            print(f"round {rnd + 1}/{args.rounds}: {name} {env}", file=sys.stderr, flush=True)
            try:
                res = run_variant(args, model, prompts, env, work, f"{rnd}{i}")
            except (RuntimeError, AssertionError, OSError, ValueError,
                    subprocess.TimeoutExpired) as exc:  # recorded: the next variant runs
                print(f"{name}: FAILED: {exc}", file=sys.stderr)
                failed.append({"variant": name, "env": env, "round": rnd,
                               "error": str(exc)[-1500:]})
            else:
                doc["runs"].append(res | {"variant": name, "env": env, "round": rnd})
            save(args, doc, failed)  # after every run: a bench stopped early keeps its runs
    print(format_summary(doc))
    for f in failed:
        print(f"{f['variant']} round {f['round']}: FAILED: {f['error']}")
    if args.json:
        print(f"wrote {args.json}")
    wrong = sum(r["total"] - r["exact"] for r in summarize(doc))
    return 1 if failed or wrong or not doc["runs"] else 0


def save(args: argparse.Namespace, doc: dict[str, Any], failed: list[dict[str, Any]]) -> None:
    if args.json:
        write_json(args.json, config=doc["config"], env=machine_info("cpu") | {
            "host": socket.gethostname()}, summary=summarize(doc), prompts=doc["prompts"],
            reference=doc["reference"], runs=doc["runs"], failed=failed)

def main(argv: list[str] | None = None) -> int:
    from kvstage.cli import run_program

    return run_program(sys.modules[__name__], "python -m bench.serving_netns", argv)


if __name__ == "__main__":
    sys.exit(main())
