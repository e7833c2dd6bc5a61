"""What an api_server that serves nothing costs: CPU per process, per second idle.

    .venv-vllm/bin/python -m bench.idle_cpu --out /tmp/idle-cpu
    .venv-vllm/bin/python -m bench.idle_cpu --tp 2 --kinds plain,kvstage-consumer

Servers (``--kinds``, `bench.step_kinds` kinds: a plain api_server, kvstage's connector as
producer or consumer on the host path, vLLM's do-nothing base connector
``null-connector``, ...), the tiny Gemma3 (`kvstage.testing.tiny_gemma3`) with
`TINY_CPU_ENGINE_ARGS`, each on its own core (``taskset``; ``--tp 2``: its own two cores,
``VLLM_CPU_OMP_THREADS_BIND="a|b"``), as many at once as ``--cores`` allows, the rest
after. Each server, once /health answers: ``--requests`` requests (default 0: the user's
case, an instance that never got one), ``--settle-s`` seconds, then ``--idle-s`` seconds
with nothing sent to it (not even /health; ``--kv-params`` gives the requests
``kv_transfer_params``, e.g. a prefill's whose KV no decode reads). Per process of its
process group (the api_server, the engine core, each worker; vLLM's process titles): the
CPU it used (utime + stime of ``/proc/<pid>/stat``, every thread) per second of wall time,
in percent of one core, and its busiest threads. One row per process:
``server | process | pid | CPU % of a core | context switches/s (its live threads: how
often it runs) | threads | top threads``; ``<out>/idle_cpu.md`` and
``<out>/idle_cpu.json``, logs under ``<out>/logs``. ``--env KEY=VALUE`` sets an environment
variable on every server (a vLLM setting tried against the spin, or ``PYTHONPATH`` for a
connector of one's own: a kind ``MODULE:CLASS[:ROLE]`` serves ``CLASS`` of ``MODULE`` as
``kv_connector`` / ``kv_connector_module_path``, role ``kv_both`` unless given). Every
server started is stopped, by process group, whatever happens (SIGTERM included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.step_cost import group_pids
from bench.step_kinds import KINDS, kv_config
from bench.stream import add_kv_extra, begin, first_and_gaps, kv_extra, write_results
from kvstage.serving import TINY_CPU_ENGINE_ARGS, served_model
from kvstage.serving.cluster import api_server_instance, free_ports
from kvstage.serving.engine_args import with_user_flags
from kvstage.serving.instances import Instance
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3

TICK = os.sysconf("SC_CLK_TCK")
READY_S = 600.0


def _cpu_s(stat: str) -> float:
    rest = stat.rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / TICK  # utime + stime


def switches(pid: int, tid: str) -> int:
    """Context switches (voluntary + not) of one thread so far: how often it ran."""
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        text = f.read()
    return sum(int(text.split(key)[1].split()[0])
               for key in ("\nvoluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:"))


def process_cpu(pid: int) -> tuple[str, float, dict[str, float], int] | None:
    """(name, CPU seconds so far, CPU seconds by thread, context switches of its live
    threads) of one process; None once it is gone. The process's CPU is its
    ``/proc/<pid>/stat`` (every thread, ended ones too); its name vLLM's process title
    (``VLLM::EngineCore``, ``VLLM::Worker_TP0``) when set, else the command's
    (``resource_tracker`` for multiprocessing's); a thread's its name and, but for the main
    one, ``+N``, its id's offset from the process's (as `bench.step_cost`)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    name = (argv.split()[0] if argv.startswith("VLLM") else "resource_tracker"
            if "resource_tracker" in argv else text[text.index("(") + 1:text.rindex(")")])
    threads: dict[str, float] = {}
    woke = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                t = f.read()
            woke += switches(pid, tid)
        except (OSError, ValueError):
            continue  # a thread that ended while being read
        label = t[t.index("(") + 1:t.rindex(")")]
        threads[label if tid == str(pid) else f"{label}+{int(tid) - pid}"] = _cpu_s(t)
    return name, _cpu_s(text), threads, woke


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/idle-cpu")
    p.add_argument("--kinds", default="plain,kvstage-producer,kvstage-consumer",
                   help=f"comma-separated server kinds, from {','.join(KINDS)}, or "
                   "MODULE:CLASS[:ROLE] (a connector of one's own)")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2),
                   help="--tensor-parallel-size of every server (2: two cores each)")
    p.add_argument("--cores", default=",".join(map(str, sorted(os.sched_getaffinity(0)))),
                   help="cores the servers may take, one (--tp 2: two) per server")
    p.add_argument("--idle-s", type=float, default=20.0)
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="seconds between ready (and the requests) and the idle window")
    p.add_argument("--requests", type=int, default=0,
                   help="requests served before the idle window (0: none, ever)")
    p.add_argument("--kv-params", type=json.loads, default=None, metavar="JSON",
                   help="kv_transfer_params of those requests (e.g. '{\"do_remote_decode\": "
                   "true}': a prefill's request whose KV no decode reads)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of every server (repeatable)")
    p.add_argument("--flag", action="append", default=[], metavar="FLAG",
                   help="api_server flag added to every server, verbatim (repeatable; "
                   "--flag=--x --flag=1 for a flag with a value)")
    p.add_argument("--seed", type=int, default=0)
    add_kv_extra(p)
    a = p.parse_args(argv)
    a.kinds = tuple(k for k in a.kinds.split(",") if k)
    if not a.kinds or any(k not in KINDS and len(k.split(":")) not in (2, 3)
                          for k in a.kinds):
        p.error(f"--kinds: expected names from {','.join(KINDS)} or MODULE:CLASS[:ROLE], "
                f"got {','.join(a.kinds)!r}")
    try:
        a.cores = [int(c) for c in a.cores.split(",") if c]
    except ValueError:
        p.error(f"--cores: expected comma-separated core numbers, got {a.cores!r}")
    if not a.cores or not set(a.cores) <= os.sched_getaffinity(0) or len(a.cores) < a.tp:
        p.error(f"--cores {a.cores}: need at least --tp ({a.tp}) cores of this process's "
                f"{sorted(os.sched_getaffinity(0))}")
    if not 0 < a.idle_s <= 600 or not 0 <= a.settle_s <= 120 or not 0 <= a.requests <= 100:
        p.error("--idle-s in (0, 600], --settle-s in [0, 120], --requests in [0, 100]")
    if any("=" not in e for e in a.env):
        p.error(f"--env: expected KEY=VALUE, got {a.env}")
    a.env = dict(e.split("=", 1) for e in a.env)
    a.extra = kv_extra(p, a)
    return a


def kind_config(kind: str, extra: dict[str, Any]) -> dict[str, Any] | None:
    """`bench.step_kinds.kv_config`, or for ``MODULE:CLASS[:ROLE]`` that connector."""
    if kind in KINDS:
        return kv_config(kind, extra)
    module, cls, *role = kind.split(":")
    return {"kv_connector": cls, "kv_connector_module_path": module,
            "kv_role": role[0] if role else "kv_both"}


def instance(i: int, kind: str, model: str, cores: tuple[int, ...], port: int,
             side_port: int, logs: Path, args: argparse.Namespace) -> Instance:
    engine = TINY_CPU_ENGINE_ARGS
    flags = [*args.flag, *(["--tensor-parallel-size", str(args.tp)] if args.tp > 1 else [])]
    if flags:
        engine = with_user_flags(engine, flags)
    env = dict(args.env)
    if len(cores) > 1:  # vLLM's CPU worker: "|" between ranks, "," within one
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, cores)))
        env.setdefault("OMP_NUM_THREADS", "1")
    label = kind if kind in KINDS else kind.split(":")[1]
    return api_server_instance(
        f"{i}-{label}-tp{args.tp}", "single", model, port=port, log_dir=logs,
        engine_args=engine, kv_config=kind_config(kind, args.extra), device="cpu",
        cores=cores, side_channel_port=None if KINDS.get(kind, ()) is None else side_port,
        env=env)


def measure(servers: list[tuple[str, Instance]], args: argparse.Namespace,
            rng: Any) -> list[dict[str, Any]]:
    """Ready servers: the requests, the settle, then each process's CPU over the idle
    window."""
    for _, s in servers:
        if args.requests:
            name = served_model(s.url)
            for _ in range(args.requests):
                first_and_gaps(s.url, {"model": name, "max_tokens": 16, "temperature": 0.0,
                                       "prompt": rng.integers(4, VOCAB_SIZE, 60).tolist(),
                                       "ignore_eos": True,
                                       **({"kv_transfer_params": args.kv_params}
                                          if args.kv_params is not None else {})})
    time.sleep(args.settle_s)
    pids = [group_pids(s.pid) for _, s in servers]
    before = [{p: process_cpu(p) for p in ps} for ps in pids]
    t0 = time.monotonic()
    time.sleep(args.idle_s)
    wall = time.monotonic() - t0
    after = [{p: process_cpu(p) for p in ps} for ps in pids]
    rows = []
    for (kind, s), b, a in zip(servers, before, after, strict=True):
        for pid in sorted(a):
            x0, x1 = b[pid], a[pid]
            if x0 is None or x1 is None:
                continue
            used = {n: v - x0[2].get(n, 0.0) for n, v in x1[2].items()}
            top = sorted(((n, v) for n, v in used.items() if v > 0), key=lambda kv: -kv[1])
            rows.append({"server": s.name, "kind": kind, "tp": args.tp,
                         "process": "api_server" if pid == s.pid else x1[0],
                         "pid": pid, "cpu_s": round(x1[1] - x0[1], 3), "wall_s": round(wall, 2),
                         "cpu_pct": round(100 * (x1[1] - x0[1]) / wall, 2),
                         "switches_per_s": round((x1[3] - x0[3]) / wall, 1),
                         "threads": len(x1[2]),
                         "threads_cpu_s": {n: round(v, 2) for n, v in top}})
    return rows


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    kv = f" (kv_transfer_params {args.kv_params})" if args.kv_params is not None else ""
    lines = [f"idle {args.idle_s:g} s after {args.requests} requests{kv}, --tp {args.tp}, "
             f"env {args.env or '-'}, flags {args.flag or '-'}, kv extra {args.extra or '-'}",
             "", "| server | process | pid | CPU % of a core | switches/s | threads | top threads "
             "(CPU s) |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        top = ", ".join(f"{n} {v:g}" for n, v in list(r["threads_cpu_s"].items())[:3]) or "-"
        lines.append(f"| {r['server']} | {r['process']} | {r['pid']} | {r['cpu_pct']:.2f} | "
                     f"{r['switches_per_s']:g} | {r['threads']} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out, model, rng, started = begin(args, build_tiny_gemma3, "tiny-gemma3")
    per = len(args.cores) // args.tp
    slots = [tuple(args.cores[i * args.tp:(i + 1) * args.tp]) for i in range(per)]
    others = os.sched_getaffinity(0) - set(args.cores)
    if others:  # this process off the servers' cores
        os.sched_setaffinity(0, others)
    rows: list[dict[str, Any]] = []
    kinds = list(enumerate(args.kinds))
    for start in range(0, len(kinds), per):
        batch = kinds[start:start + per]
        ports = free_ports(2 * len(batch))
        servers = [(kind, instance(i, kind, model, slots[j], ports[j], ports[len(batch) + j],
                                   out / "logs", args))
                   for j, (i, kind) in enumerate(batch)]
        try:
            for _, s in servers:
                s.spawn()
            for _, s in servers:
                s.wait_ready(READY_S)
            rows += measure(servers, args, rng)
        finally:
            for _, s in servers:
                s.stop()
        print(table([r for r in rows if r["server"] in {s.name for _, s in servers}], args),
              flush=True)
    text = table(rows, args)
    write_results(out, "idle_cpu", text, args, started, {"rows": rows})
    print(f"wrote {out / 'idle_cpu.md'} and {out / 'idle_cpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
