"""Serving benchmark: vLLM's own load client against P/D deployments behind vllm-router.

    .venv-vllm/bin/python -m bench.serving --out benchmarks/serving

Deployments (`kvstage.serving`: api_servers + vllm-router on 127.0.0.1, prefills on the first
half of the cores, decodes on the rest; singles on one core), each started, measured and
stopped in turn (``--rounds`` > 1 repeats the whole list in a rotated order, so no
deployment always runs first or last):
- ``kvstage-hybrid``: 1P1D, KVStageConnector, the tiny hybrid Gemma3;
- ``kvstage-hybrid-2p2d``: the same with 2 prefills and 2 decodes behind one router (round
  robin on both sides): every decode's request count is reported, so "both decodes used" is
  read from the table;
- ``nixl-nonhybrid`` / ``nixl-hybrid``: 1P1D, vLLM's NixlConnector host path (forced on for
  CPU), the tiny Llama (full attention only: vLLM's path is right there) / the hybrid Gemma3;
- ``single-hybrid`` / ``single-nonhybrid``: one plain api_server (the reference).

Per deployment: an exactness pass (``--exact-prompts`` greedy prompts of 5 to 300 tokens, 8
in flight, `kvstage.serving.complete`, ignore_eos) whose token ids are compared with the single
engine of the same model, then for each ``--concurrency`` one run of ``vllm.benchmarks.serve``
(its own argparse: ``add_cli_args``, then ``main``): random dataset (same seed, so the same
prompts everywhere: both tiny models share one word-level tokenizer), temperature 0,
ignore_eos. Reported: completed/failed, request throughput, TTFT p50/p99, ITL mean, the
generated texts that differ from the single engine's at that point, and from the decode's
/metrics (deltas over the run) the KV transfer per request: kvstage's READ posted to last
h2d done (``vllm:kvstage_h2d_time_seconds``: the READ with the h2d pipelined behind it), or
for vLLM's own connector its READ time (``vllm:nixl_xfer_time_seconds``; its h2d is not
timed), and that time's share of the mean TTFT.

Writes ``<out>/serving.json`` and ``<out>/serving.md``; every engine's log under
``<out>/logs``. Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvstage.serving import (
    TINY_CPU_ENGINE_ARGS,
    PDCluster,
    complete,
    metric_total,
    served_model,
    single_instance,
)
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3
from kvstage.testing.tiny_llama import build_tiny_llama

# name -> (P/D connector or None for a single engine, model)
CONFIGS: dict[str, tuple[str | None, str]] = {
    "kvstage-hybrid": ("kvstage", "hybrid"),
    "kvstage-hybrid-2p2d": ("kvstage", "hybrid"),
    "nixl-nonhybrid": ("nixl", "nonhybrid"),
    "nixl-hybrid": ("nixl", "hybrid"),
    "single-hybrid": (None, "hybrid"),
    "single-nonhybrid": (None, "nonhybrid"),
}
# name -> (prefills, decodes) where not 1P1D
TOPOLOGY: dict[str, tuple[int, int]] = {"kvstage-hybrid-2p2d": (2, 2)}
REQUESTS = "vllm:request_success_total"  # per decode: which decodes the router used
DECODE_METRICS = (REQUESTS,
    "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_num_failed_transfers_total", "vllm:kvstage_read_bytes_total",
    "vllm:kvstage_read_time_seconds_sum", "vllm:kvstage_h2d_time_seconds_sum",
    "vllm:kvstage_h2d_time_seconds_count", "vllm:kvstage_read_failures_total",
)
EXACT_LENS = (5, 32, 40, 64, 100, 150, 200, 300)
START_S = 600.0  # engines load in parallel; on a shared 2-core VM under load 300 s was short


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/serving", help="output directory")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {','.join(CONFIGS)}")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="random input lengths in input-len x [1 - r, 1 + r]")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--exact-prompts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in CONFIGS]
    if bad or not names:
        p.error(f"--configs: unknown {bad or 'empty list'}; choose from {','.join(CONFIGS)}")
    if min(args.concurrency) < 1 or args.num_prompts < 1 or args.rounds < 1:
        p.error("--concurrency, --num-prompts and --rounds must be >= 1")
    if not 0 <= args.range_ratio < 1 or args.input_len < 8 or args.output_len < 2:
        p.error("--range-ratio must be in [0, 1), --input-len >= 8, --output-len >= 2")
    if args.input_len * (1 + args.range_ratio) + args.output_len > 512:
        p.error("longest prompt + output must fit max_model_len 512 (TINY_CPU_ENGINE_ARGS)")
    args.configs = names
    return args


@contextlib.contextmanager
def deployment(name: str, model: str, logs: Path) -> Iterator[tuple[str, list[str]]]:
    """(router or single url, decode urls: none for a single engine) of a started
    deployment; stopped after."""
    connector, _ = CONFIGS[name]
    if connector is None:
        with single_instance(model, log_dir=logs, start_timeout=START_S,
                             engine_args=TINY_CPU_ENGINE_ARGS) as s:
            yield s.url, []
    else:
        num_prefill, num_decode = TOPOLOGY.get(name, (1, 1))
        with PDCluster(model=model, connector=connector, log_dir=logs,
                       num_prefill=num_prefill, num_decode=num_decode,
                       start_timeout=START_S, engine_args=TINY_CPU_ENGINE_ARGS) as c:
            yield c.router_url, [d.url for d in c.decodes]


def exact_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lens = [EXACT_LENS[i % len(EXACT_LENS)] for i in range(n)]
    return [rng.integers(4, VOCAB_SIZE, size=k).tolist() for k in lens]


def load_point(url: str, model_path: str, concurrency: int, args: argparse.Namespace) -> dict:
    """One ``vllm bench serve`` run (vLLM's own client, in this process)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    bench = parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", served_model(url), "--tokenizer", model_path,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len),
        "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
        "--temperature", "0", "--seed", str(args.seed), "--percentile-metrics", "ttft,itl",
        "--metric-percentiles", "50,99", "--disable-tqdm", "--ready-check-timeout-sec", "60",
        "--save-detailed",  # keeps generated_texts in the returned dict (no file written)
    ])
    return main(bench)


def decode_metrics(urls: list[str]) -> list[dict[str, float]]:
    """Each decode's counters (none for a single engine)."""
    if urls:
        time.sleep(1.0)  # the last step's stats reach the front end with the next output
    return [{m: metric_total(url, m) for m in DECODE_METRICS} for url in urls]


def run_deployment(name: str, model: str, args: argparse.Namespace, logs: Path) -> dict:
    out: dict[str, Any] = {"config": name, "points": {}, "error": None}
    start = time.monotonic()
    try:
        with deployment(name, model, logs / f"{name}-{int(time.time())}") as (url, decodes):
            out["start_s"] = round(time.monotonic() - start, 1)
            results = complete(url, exact_prompts(args.exact_prompts, args.seed),
                               max_tokens=args.output_len, concurrency=8)
            out["exact"] = [r.token_ids if r.ok else f"ERROR {r.error}" for r in results]
            for conc in args.concurrency:
                before = decode_metrics(decodes)
                res = load_point(url, model, conc, args)
                after = decode_metrics(decodes)
                point = {k: res.get(k) for k in (
                    "completed", "failed", "duration", "request_throughput", "median_ttft_ms",
                    "p99_ttft_ms", "mean_ttft_ms", "mean_itl_ms", "p99_itl_ms")}
                point["texts"] = res.get("generated_texts", [])
                point["errors"] = [e for e in res.get("errors", []) if e][:5]
                deltas = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
                point["decode_metrics"] = {k: sum(d[k] for d in deltas) for k in DECODE_METRICS} \
                    if deltas else {}
                point["requests_per_decode"] = [int(d[REQUESTS]) for d in deltas]
                out["points"][str(conc)] = point
                print(f"{name} c={conc}: {point['completed']} done, "
                      f"{point['request_throughput']:.2f} req/s, "
                      f"TTFT p50 {point['median_ttft_ms']:.1f} ms", flush=True)
    except Exception as e:  # a deployment that fails is reported, the others still run
        out["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"{name}: FAILED {out['error']}", file=sys.stderr, flush=True)
    return out


def transfer_share(point: dict) -> tuple[float | None, float | None]:
    """(KV transfer ms per request on the decode, its share of the mean TTFT)."""
    m = point.get("decode_metrics") or {}
    loads = m.get("vllm:kvstage_h2d_time_seconds_count", 0)
    if loads:  # kvstage: READ posted -> last h2d done
        per_request_ms = 1e3 * m["vllm:kvstage_h2d_time_seconds_sum"] / loads
    elif m.get("vllm:nixl_xfer_time_seconds_count", 0):  # vLLM's: its READs only
        per_request_ms = 1e3 * (m["vllm:nixl_xfer_time_seconds_sum"]
                                / m["vllm:nixl_xfer_time_seconds_count"])
    else:
        return None, None
    return per_request_ms, per_request_ms / point["mean_ttft_ms"]


def summarize(runs: list[dict], args: argparse.Namespace) -> tuple[list[dict], str]:
    refs = {CONFIGS[r["config"]][1]: r for r in runs
            if CONFIGS[r["config"]][0] is None and not r["error"]}
    rows = []
    for r in runs:
        ref = refs.get(CONFIGS[r["config"]][1])
        exact_wrong = None
        if ref is not None and r.get("exact") is not None:
            exact_wrong = sum(a != b for a, b in zip(r["exact"], ref["exact"], strict=True))
        for conc, p in r["points"].items():
            wrong = None
            ref_texts = ref["points"].get(conc, {}).get("texts") if ref is not None else None
            if ref_texts and len(p["texts"]) == len(ref_texts) == p["completed"]:
                wrong = sum(a != b for a, b in zip(p["texts"], ref_texts, strict=True))
            ms, share = transfer_share(p)
            rows.append({"config": r["config"], "round": r.get("round", 0),
                         "concurrency": int(conc),
                         "completed": p["completed"], "failed": p["failed"],
                         "req_per_s": p["request_throughput"], "ttft_p50_ms": p["median_ttft_ms"],
                         "ttft_p99_ms": p["p99_ttft_ms"], "itl_mean_ms": p["mean_itl_ms"],
                         "wrong_texts": wrong, "exact_wrong": exact_wrong,
                         "kv_ms_per_request": ms, "kv_share_of_ttft": share,
                         "requests_per_decode": p.get("requests_per_decode", [])})
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    lines = [
        "| deployment | round | conc. | completed / failed | req/s | TTFT p50 ms | TTFT p99 ms | "
        "ITL mean ms | wrong vs single (bench texts; exact pass) | KV transfer ms/req "
        "(share of mean TTFT) | requests per decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in sorted(rows, key=lambda w: (list(CONFIGS).index(w["config"]), w["concurrency"],
                                         w["round"])):
        kv = "-" if w["kv_ms_per_request"] is None else \
            f"{w['kv_ms_per_request']:.2f} ({100 * w['kv_share_of_ttft']:.1f}%)"
        lines.append(
            f"| {w['config']} | {w['round']} | {w['concurrency']} | "
            f"{w['completed']} / {w['failed']} | "
            f"{f(w['req_per_s'], '.2f')} | {f(w['ttft_p50_ms'], '.1f')} | "
            f"{f(w['ttft_p99_ms'], '.1f')} | {f(w['itl_mean_ms'], '.2f')} | "
            f"{f(w['wrong_texts'], 'd')}/{args.num_prompts}; "
            f"{f(w['exact_wrong'], 'd')}/{args.exact_prompts} | {kv} | "
            f"{' + '.join(map(str, w['requests_per_decode'])) or '-'} |")
    for r in runs:
        if r["error"]:
            lines.append(f"\n{r['config']}: failed: {r['error'][:300]}")
    return rows, "\n".join(lines) + "\n"


def source_state() -> dict[str, Any]:
    """The commit and the files of src/ that differ from it (engines import the tree as it
    is when each starts: a shared checkout may carry others' uncommitted edits)."""
    import subprocess

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return {"head": git("rev-parse", "HEAD"),
            "uncommitted_src": git("status", "--porcelain", "--", "src").splitlines()}


def write(out: Path, runs: list[dict], args: argparse.Namespace, started: float) -> str:
    rows, table = summarize(runs, args)
    meta = {"argv": sys.argv, "args": vars(args), "wall_s": round(time.monotonic() - started, 1),
            "source": source_state()}
    slim = [{**r, "points": {c: {k: v for k, v in p.items() if k != "texts"}
                             for c, p in r["points"].items()}} for r in runs]
    (out / "serving.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": slim},
                                                 indent=1) + "\n")
    (out / "serving.md").write_text(table)
    texts = {f"{r['config']}/{r['round']}/{c}": p["texts"] for r in runs
             for c, p in r["points"].items()}
    (out / "texts.json").write_text(json.dumps(texts) + "\n")  # what the bench compared
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = {"hybrid": str(build_tiny_gemma3(out / "models" / "tiny-gemma3")),
              "nonhybrid": str(build_tiny_llama(out / "models" / "tiny-llama"))}
    runs: list[dict] = []
    started = time.monotonic()
    for rnd in range(args.rounds):
        order = args.configs[rnd % len(args.configs):] + args.configs[:rnd % len(args.configs)]
        for name in order:
            run = {**run_deployment(name, models[CONFIGS[name][1]], args, out / "logs"),
                   "round": rnd}
            runs.append(run)
            table = write(out, runs, args, started)  # after each: a cut-short run keeps its data
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
