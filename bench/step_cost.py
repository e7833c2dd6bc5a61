"""What KVStageConnector costs an instance per engine step, when it moves no KV at all.

    .venv-vllm/bin/python -m bench.step_cost --out benchmarks/step-cost

Arrangements (``--arrangements``, `bench.step_kinds`), each a set of api_servers started
together, all pinned to ONE core (``--core``, default the last; the client runs on the
others), the tiny Llama, `TINY_CPU_ENGINE_ARGS`: plain servers beside kvstage consumers or
producers, vLLM's NIXL consumer and a do-nothing connector.
Every request is a plain one (no ``kv_transfer_params``: nothing is saved, READ or
copied), so what differs between the servers is what the connector does on its own: its
NIXL agent's threads, its side-channel listener and the per-step hooks. ``--rounds`` rounds
of one streamed request (``--input-len`` random ids, ``--output-len`` tokens) to each
server in turn, one request in flight at a time, the order rotated every round, after two
warm-up requests each, each request ``--settle-s`` after the last one ended (`bench.stream`:
back to back, the server measured after vLLM's busy NIXL consumer's request competed with
one spinning group, the others with two: the ``four`` ratios of before). ``--trials``
starts each arrangement afresh that many times, odd trials with the servers started and
rotated in reverse order: two identical servers differ by a few percent, the later-started
one slower in every run seen, so an even number of trials cancels what depends on position.

Per server: mean TTFT and ITL (the gaps between streamed tokens) and, to the plain server
of the same trial, the ratios of the mean, 10th and 90th percentiles of its requests' TTFTs
and of its requests' mean gaps, each with a 95 % interval from a paired bootstrap of the
rounds (`bench.ab_stats`: one request's mean gap
moves by tens of percent from one request to the next on this box, so a ratio without its
interval says little); for kvstage servers started with ``--kv-extra
kvstage_time_hooks=true``, the milliseconds per engine step the connector's hooks took,
scheduler and worker side, from their own ``vllm:kvstage_hook_*`` counters
(`kvstage.integrations.vllm.hook_time`; off by default, as the A/B measures the connector
as it runs by default); and the CPU time
(utime + stime from ``/proc/<pid>/task/<tid>/stat``) every thread of its process group took
over the measured rounds, by thread (its name, and for threads other than a process's main
one ``+N``, its id's offset from the process's: NIXL's and UCX's threads carry the
process's name), so the difference can be attributed.

Writes ``<out>/step_cost.json`` (each request's TTFT and gaps included) and
``<out>/step_cost.md``; logs under ``<out>/logs``. ``--table <out>/step_cost.json`` prints
a saved run's tables again, its ratios recomputed, and starts nothing.
Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.ab_stats import across_starts, ratios
from bench.step_kinds import ARRANGEMENTS, KINDS, kv_config
from bench.stream import (
    add_kv_extra,
    add_settle,
    begin,
    client_off,
    first_and_gaps,
    kv_extra,
    write_results,
)
from kvstage.serving import TINY_CPU_ENGINE_ARGS, served_model
from kvstage.serving.client import metric_by_label
from kvstage.serving.cluster import api_server_instance, free_ports
from kvstage.serving.instances import Instance
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE  # the tiny Llama shares its tokenizer

TICK = os.sysconf("SC_CLK_TCK")
HOOK_SECONDS, HOOK_CALLS = "vllm:kvstage_hook_seconds_total", "vllm:kvstage_hook_calls_total"
#: per side, the hook called once per engine step (its calls count the steps)
STEP_HOOK = {"scheduler": "scheduler.build_connector_meta",
             "worker": "worker.get_transfer_results"}


def hook_totals(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """The connector's hook seconds and calls so far, by hook (`hook_time`)."""
    return metric_by_label(url, HOOK_SECONDS, "hook"), metric_by_label(url, HOOK_CALLS, "hook")


def hook_ms_per_step(before: tuple[dict[str, float], dict[str, float]],
                     after: tuple[dict[str, float], dict[str, float]],
                     by_hook: bool = False) -> dict[str, float]:
    """Per side (or per hook), the milliseconds of its hooks over the steps between two
    totals."""
    out = {}
    for side, step_hook in STEP_HOOK.items():
        steps = after[1].get(step_hook, 0.0) - before[1].get(step_hook, 0.0)
        spent = {h: v - before[0].get(h, 0.0) for h, v in after[0].items()
                 if h.startswith(side + ".")}
        if steps <= 0:
            continue
        if by_hook:
            out.update({h: round(1e3 * v / steps, 4) for h, v in spent.items()})
        else:
            out[side] = round(1e3 * sum(spent.values()) / steps, 4)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/step-cost")
    p.add_argument("--arrangements", default=",".join(ARRANGEMENTS),
                   help=f"comma-separated, from {','.join(ARRANGEMENTS)}")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--core", type=int, default=max(os.sched_getaffinity(0)))
    add_kv_extra(p)
    add_settle(p)
    p.add_argument("--trials", type=int, default=1,
                   help="times each arrangement is started afresh and measured (two "
                   "identical servers differ by a few percent for their whole life)")
    p.add_argument("--fixed-layout", action="store_true",
                   help="start every server without address-space randomisation "
                   "(setarch -R) and with PYTHONHASHSEED=0: fewer ways for two starts of "
                   "the same server to differ")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", metavar="JSON", default=None,
                   help="start nothing: print the tables of a step_cost.json this bench "
                   "wrote, its ratios recomputed")
    a = p.parse_args(argv)
    names = [n for n in a.arrangements.split(",") if n]
    if not names or any(n not in ARRANGEMENTS for n in names):
        p.error(f"--arrangements: expected names from {','.join(ARRANGEMENTS)}, "
                f"got {a.arrangements!r}")
    if a.core not in os.sched_getaffinity(0):
        p.error(f"--core {a.core} is not one this process may use "
                f"({sorted(os.sched_getaffinity(0))})")
    if not 1 <= a.trials <= 10:
        p.error(f"--trials: expected 1..10, got {a.trials}")
    if a.rounds < 1 or not 1 <= a.input_len <= 400 or not 2 <= a.output_len <= 100:
        p.error("--rounds >= 1, --input-len in [1, 400], --output-len in [2, 100]")
    extra = kv_extra(p, a)
    a.arrangements, a.extra = names, extra
    return a


def group_pids(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (a server's api_server and engine core)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # fields[2]: pgrp (the 5th field of stat)
                out.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while being read
    return out


def thread_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds so far of every thread of process group ``pgid``, by thread name."""
    out: dict[str, float] = {}
    for pid in map(str, group_pids(pgid)):
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
                name = text[text.index("(") + 1:text.rindex(")")]
                # threads NIXL, UCX and torch start keep their process's name: told apart
                # by their id's offset from the process's (creation order, stable)
                name = name if tid == pid else f"{name}+{int(tid) - int(pid)}"
                rest = text.rsplit(")", 1)[1].split()
                out[name] = out.get(name, 0.0) + (int(rest[11]) + int(rest[12])) / TICK
        except (OSError, ValueError, IndexError):
            continue  # a process or thread that ended while being read
    return out


def start_servers(kinds: tuple[str, ...], model: str, core: int, logs: Path,
                  extra: dict[str, Any], fixed_layout: bool = False) -> list[Instance]:
    ports = free_ports(2 * len(kinds))
    servers = []
    for i, kind in enumerate(kinds):
        spec = KINDS[kind]
        kv = kv_config(kind, extra)
        server = api_server_instance(
            f"{i}-{kind}", "single", model, port=ports[i], log_dir=logs,
            engine_args=TINY_CPU_ENGINE_ARGS, kv_config=kv, device="cpu", cores=(core,),
            side_channel_port=None if spec is None else ports[len(kinds) + i],
            env={"PYTHONHASHSEED": "0"} if fixed_layout else None)
        if fixed_layout:
            server.argv = ["setarch", platform.machine(), "-R", *server.argv]
        servers.append(server)
    for s in servers:
        s.spawn()
    for s in servers:
        s.wait_ready(600.0)
    return servers


def measure(kinds: tuple[str, ...], servers: list[Instance], args: argparse.Namespace,
            rng: np.random.Generator) -> list[dict[str, Any]]:
    model = served_model(servers[0].url)

    def request(url: str) -> tuple[float, list[float]]:
        body = {"model": model, "prompt": rng.integers(4, VOCAB_SIZE, size=args.input_len).tolist(),
                "max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
        return first_and_gaps(url, body)

    for s in servers:
        for _ in range(2):
            request(s.url)
    time.sleep(args.settle_s)
    timed = [i for i, kind in enumerate(kinds) if kind.startswith("kvstage")]
    hooks0 = {i: hook_totals(servers[i].url) for i in timed}
    cpu0 = [thread_cpu(s.pid) for s in servers]
    ttft: list[list[float]] = [[] for _ in servers]
    itl: list[list[float]] = [[] for _ in servers]
    gaps_by_round: list[list[list[float]]] = [[] for _ in servers]
    for r in range(args.rounds):
        for k in range(len(servers)):
            i = (k + r) % len(servers)
            time.sleep(args.settle_s)
            first, gaps = request(servers[i].url)
            ttft[i].append(first)
            itl[i].extend(gaps)
            gaps_by_round[i].append([round(1e3 * g, 3) for g in gaps])
    cpu1 = [thread_cpu(s.pid) for s in servers]
    # the hook totals leave an instance about once a second, on a step: one more request
    # a second later hands out the rounds' (the ratio counts the steps of the same totals)
    time.sleep(1.1)
    for i in timed:
        request(servers[i].url)
    hooks1 = {i: hook_totals(servers[i].url) for i in timed}
    rows: list[dict[str, Any]] = []
    for i, kind in enumerate(kinds):
        used = {n: v - cpu0[i].get(n, 0.0) for n, v in cpu1[i].items()}
        rows.append({"server": servers[i].name, "kind": kind,
                     "ttft_ms": 1e3 * float(np.mean(ttft[i])),
                     "itl_ms": 1e3 * float(np.mean(itl[i])),
                     "ttft_median_ms": 1e3 * float(np.median(ttft[i])),
                     "itl_median_ms": 1e3 * float(np.median(itl[i])),
                     # by round, for the paired intervals (`bench.ab_stats`)
                     "ttft_by_round_ms": [[round(1e3 * v, 3)] for v in ttft[i]],
                     "gaps_by_round_ms": gaps_by_round[i],
                     "hook_ms_per_step": (hook_ms_per_step(hooks0[i], hooks1[i])
                                          if i in timed else {}),
                     "hook_ms_by_hook": (hook_ms_per_step(hooks0[i], hooks1[i], by_hook=True)
                                         if i in timed else {}),
                     "cpu_s": round(sum(used.values()), 2),
                     "cpu_by_thread": {n: round(v, 2) for n, v in
                                       sorted(used.items(), key=lambda kv: -kv[1]) if v > 0}})
    return rows


def trial(name: str, t: int, model: str, args: argparse.Namespace,
          rng: np.random.Generator, logs: Path) -> list[dict[str, Any]]:
    """One fresh start of arrangement ``name``: its rows in the arrangement's order, with
    their ratios to its first (plain) server. Odd trials start and rotate the servers in
    reverse order, so what depends on a server's position cancels over two trials."""
    kinds = ARRANGEMENTS[name]
    order = list(range(len(kinds)))[::-1 if t % 2 else 1]
    servers = start_servers(tuple(kinds[i] for i in order), model, args.core, logs,
                            args.extra, args.fixed_layout)
    try:
        measured = measure(tuple(kinds[i] for i in order), servers, args, rng)
    finally:
        for s in servers:
            s.stop()
    rows: list[dict[str, Any]] = [{} for _ in kinds]
    for position, i in enumerate(order):
        rows[i] = {**measured[position], "server": f"{i}-{kinds[i]}", "started": position}
    return with_ratios(rows)


def _mean_gaps(row: dict[str, Any]) -> list[list[float]]:
    return [[float(np.mean(gaps))] for gaps in row["gaps_by_round_ms"]]


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (one trial's, plain first) with each one's ratios to the plain server:
    ``<key>_x`` of the means and medians, and ``ttft_stats_x`` / ``itl_stats_x``
    (`bench.ab_stats`, over the requests: each request's TTFT, each request's mean gap)."""
    for row in rows:
        for key in ("ttft", "itl", "ttft_median", "itl_median"):
            row[f"{key}_x"] = row[f"{key}_ms"] / rows[0][f"{key}_ms"]
        row["ttft_stats_x"] = ratios(rows[0]["ttft_by_round_ms"], row["ttft_by_round_ms"])
        row["itl_stats_x"] = ratios(_mean_gaps(rows[0]), _mean_gaps(row))
    return rows


#: the ratios a table shows: (samples, statistic) of `bench.ab_stats`
SHOWN = (("ttft", "mean"), ("ttft", "p10"), ("itl", "mean"), ("itl", "p10"), ("itl", "p90"))


def table(name: str, trials: list[list[dict[str, Any]]]) -> str:
    """Per trial and server: the ratios to the plain server with their 95 % intervals over
    the rounds (`bench.ab_stats`), hook time per step, CPU by thread; with more than one
    trial, each ratio's geometric mean over them with its 95 % interval over the starts
    (`bench.ab_stats.across_starts`)."""
    head = " | ".join(f"{k.upper()} {stat} x plain [95 %]" for k, stat in SHOWN)
    lines = [f"#### {name}", "",
             f"| trial | server | TTFT ms | ITL ms | {head} | hooks ms/step (sched, worker) "
             "| CPU s | top threads (CPU s) |",
             "|---:|---|---:|---:|" + "---:|" * len(SHOWN) + "---|---:|---|"]
    for t, rows in enumerate(trials):
        for r in rows:
            top = ", ".join(f"{n} {v:g}" for n, v in list(r["cpu_by_thread"].items())[:4])
            hooks = r["hook_ms_per_step"]
            spent = (f"{hooks.get('scheduler', 0):.3f}, {hooks.get('worker', 0):.3f}"
                     if hooks else "-")
            shown = " | ".join("{:.3f} [{:.3f}, {:.3f}]".format(*r[f"{k}_stats_x"][stat])
                               for k, stat in SHOWN)
            lines.append(f"| {t} | {r['server']} | {r['ttft_ms']:.1f} | {r['itl_ms']:.2f} | "
                         f"{shown} | {spent} | {r['cpu_s']:.2f} | {top} |")
    if len(trials) > 1:  # fresh servers each trial: a process's own luck is in the spread
        for i, r in enumerate(trials[0]):
            shown = " | ".join("{:.3f} [{:.3f}, {:.3f}]".format(*across_starts(
                [rows[i][f"{k}_stats_x"][stat][0] for rows in trials])) for k, stat in SHOWN)
            lines.append(f"| over {len(trials)} starts | {r['server']} | | | {shown} | | | |")
    return "\n".join(lines) + "\n"


def retable(path: str) -> str:
    """The tables of a saved ``step_cost.json``, ratios recomputed (`with_ratios`)."""
    try:
        results = json.loads(Path(path).read_text())["results"]
        return "\n".join(table(name, [with_ratios(rows) for rows in trials])
                         for name, trials in results.items())
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"--table {path}: expected a step_cost.json this bench wrote "
                         f"(with gaps_by_round_ms), could not read it: {e!r}; rerun the "
                         "bench to get one") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table is not None:
        try:
            print(retable(args.table))
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        return 0
    out, model, rng, started = begin(args)
    results: dict[str, list[list[dict[str, Any]]]] = {}
    client_off(args.core)
    for name in args.arrangements:
        results[name] = [trial(name, t, model, args, rng, out / "logs" / name / str(t))
                         for t in range(args.trials)]
        print(table(name, results[name]), flush=True)
    text = "\n".join(table(n, rows) for n, rows in results.items())
    write_results(out, "step_cost", text, args, started, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
