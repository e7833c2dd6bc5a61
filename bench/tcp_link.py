"""`python -m bench.tcp_link`: kvstage's READ across two "hosts" against the link's own TCP
rate, in one run (root; issue 37).

Builds two network namespaces joined by a veth pair (`bench.netns`), starts in the prefill
one a `python -m bench.transfer --listen` prefill (block-major host buffer, the bench's
layout) and a plain TCP stream server (`bench.tcp_link_client --serve-stream`), then runs
`bench.tcp_link_client` in the decode one: per id mode and request size it alternates a
Python ``sendall`` stream of the request's bytes and kvstage's READ of the request, so each
ratio compares two things measured under the same noise. The bytes READ are verified.

``--variant NAME:KEY=VALUE,...`` (repeatable) runs the pair once per variant with those
variables added to both processes' environments (``P.KEY``/``D.KEY``: the prefill's or the
decode's only). UCX settings in the environment win over kvstage's own choice, so UCX's
defaults (the "before") are ``before:UCX_TCP_TX_SEG_SIZE=8k,UCX_TCP_RX_SEG_SIZE=64k``.
Variants run in turn, ``--rounds`` times, each with its own stream samples.
``--netem DELAY_MS:RATE_MBIT`` shapes the veth (tc netem). Writes ``--json`` and, with
``--png``, READ GB/s against the request size with the stream's rate as a line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import netns
from kvstage.bench.report import Column, machine_info, print_table, write_json
from kvstage.cli import run_program

PORT, STREAM_PORT, IPERF3_PORT = 5700, 5701, 5702
KEY = "tcp-link-bench-key-" + "0" * 16
START_TIMEOUT_S = 90.0
CLIENT_TIMEOUT_S = 170.0


def _variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(
                f"--variant {text!r}: expected NAME:KEY=VALUE,KEY=VALUE (e.g. "
                "wide:UCX_TCP_SNDBUF=4m)")
        env[key] = value
    if not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: the name before ':' is empty")
    return name, env


def _netem(text: str) -> tuple[float, float]:
    delay, _, rate = text.partition(":")
    try:
        return float(delay), float(rate)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--netem {text!r}: expected DELAY_MS:RATE_MBIT, e.g. 2:2000") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--sizes-mib", type=int, nargs="+", default=[8, 32, 128, 512])
    a("--ids", choices=("contiguous", "scattered", "both"), default="both")
    a("--methods", nargs="+", default=["read"],
      help="read (one transfer), splitK (K concurrent transfers), e.g. read split4")
    a("--variant", type=_variant, action="append", default=None,
      help="NAME:KEY=VALUE,... extra environment of both sides (repeatable; default: "
      "one variant, 'default', kvstage's own choice)")
    a("--rounds", type=int, default=1)
    a("--iters", type=int, default=5)
    a("--warmup", type=int, default=1)
    a("--num-blocks", type=int, default=None,
      help="pool size (gemma-3-1b blocks of 64 KiB) on both sides (default: room for the "
      "largest size twice over, for the scattered churn)")
    a("--netem", type=_netem, default=None, metavar="DELAY_MS:RATE_MBIT")
    a("--no-iperf3", action="store_true",
      help="skip iperf3 (run, when installed, 1 s before and after each size)")
    a("--json", default=None, metavar="PATH")
    a("--png", default=None, metavar="PATH")


def _wait_port(pair: netns.Pair, proc: subprocess.Popen[bytes], port: int, log: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    probe = [sys.executable, "-c", "import socket,sys; socket.create_connection("
             f"('{netns.PREFILL_IP}', {port}), timeout=1).close()"]
    while True:
        if proc.poll() is not None:
            with open(log) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"a prefill-side process exited {proc.returncode}: {tail}")
        if subprocess.run(["ip", "netns", "exec", pair.d, *probe], capture_output=True,
                          timeout=30).returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on port {port} after {START_TIMEOUT_S} s")
        time.sleep(0.5)


def run_variant(pair: netns.Pair, args: argparse.Namespace, env: dict[str, str],
                tmp: str, tag: str) -> dict[str, Any]:
    def side(prefix: str) -> dict[str, str]:
        """Variables for one side: unprefixed ones, and ``P.``/``D.`` ones for P/D only."""
        mine = {k.removeprefix(prefix): v for k, v in env.items() if k.startswith(prefix)}
        both = {k: v for k, v in env.items() if not k.startswith(("P.", "D."))}
        return netns.child_env({"KVSTAGE_KEY": KEY, **both, **mine})

    log = os.path.join(tmp, f"prefill-{tag}.log")
    prefill = pair.popen(pair.p, [sys.executable, "-m", "bench.transfer", "--listen",
                                  f"{netns.PREFILL_IP}:{PORT}", "--num-blocks",
                                  str(args.num_blocks)], env=side("P."), log=log)
    try:
        _wait_port(pair, prefill, PORT, log)
        argv = [sys.executable, "-m", "bench.tcp_link_client", "--connect",
                f"{netns.PREFILL_IP}:{PORT}", "--stream-port", str(STREAM_PORT),
                "--iperf3-port", str(IPERF3_PORT if args.iperf3 else 0),
                "--num-blocks", str(args.num_blocks), "--iters", str(args.iters),
                "--warmup", str(args.warmup), "--sizes-mib", *map(str, args.sizes_mib),
                "--modes", *args.modes, "--methods", *args.methods]
        client = pair.popen(pair.d, argv, env=side("D."), stdout=subprocess.PIPE)
        out, _ = client.communicate(timeout=CLIENT_TIMEOUT_S)
        if client.returncode != 0:
            how = (f"killed by signal {-client.returncode}" if client.returncode < 0
                   else f"exited {client.returncode}")
            raise RuntimeError(f"the decode-side client {how}")
        doc: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        with open(log) as f:
            doc["prefill_ucx"] = next((ln.strip() for ln in f if "ucx:" in ln), "")
        return doc
    finally:
        prefill.terminate()
        prefill.wait(30)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, ids, size, method): median GB/s over rounds' samples, ratio to the
    stream's median GB/s of the same variant, ids and size."""
    groups: dict[tuple[str, str, int, str], list[float]] = {}
    iperf: dict[tuple[str, str, int], list[float]] = {}
    mib: dict[tuple[str, str, int, str], float] = {}
    for res in results:
        for r in res["rows"]:
            key = (res["variant"], r["ids"], round(r["mib"]), r["method"])
            groups.setdefault(key, []).extend(r["mib"] * 2**20 / (s * 1e6)
                                              for s in r["samples_ms"])
            mib[key] = r["mib"]
            iperf.setdefault(key[:3], []).extend(r.get("iperf3_gbps", []))
    out = []
    for key, gbps in groups.items():
        variant, ids, size, method = key
        stream = float(np.median(groups[(variant, ids, size, "stream")]))
        med = float(np.median(gbps))
        out.append({"variant": variant, "ids": ids, "mib": mib[key], "method": method,
                    "gbps": med, "min_gbps": min(gbps), "max_gbps": max(gbps),
                    "samples": len(gbps), "pct_of_stream": 100 * med / stream,
                    "iperf3_gbps": float(np.median(iperf[key[:3]])) if iperf[key[:3]] else None,
                    "pct_of_iperf3": (100 * med / float(np.median(iperf[key[:3]]))
                                      if iperf[key[:3]] else None)})
    return out


COLUMNS = [
    Column("variant", "variant", align="<"),
    Column("ids", "ids", align="<"),
    Column("mib", "MiB", "{:.1f}"),
    Column("method", "what", align="<"),
    Column("samples", "n"),
    Column("gbps", "GB/s (median)", "{:.2f}"),
    Column("min_gbps", "min", "{:.2f}"),
    Column("max_gbps", "max", "{:.2f}"),
    Column("pct_of_stream", "% of stream", "{:.0f}%"),
    Column("iperf3_gbps", "iperf3 GB/s", "{:.2f}"),
    Column("pct_of_iperf3", "% of iperf3", "{:.0f}%"),
]


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    """One panel per id mode: READ GB/s per variant and method against the request size
    (log2 axis), the Python stream and iperf3 as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    modes = sorted({r["ids"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False,
                             sharey=True)
    for ax, mode in zip(axes[0], modes, strict=True):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r["ids"] != mode:
                continue
            label = (f"{r['variant']}: TCP stream (Python)" if r["method"] == "stream"
                     else f"{r['variant']}: {r['method']}")
            series.setdefault(label, []).append((r["mib"], r["gbps"]))
            if r["method"] == "stream" and r.get("iperf3_gbps"):
                series.setdefault(f"{r['variant']}: iperf3", []).append(
                    (r["mib"], r["iperf3_gbps"]))
        for label, pts in sorted(series.items()):
            xs, ys = zip(*sorted(pts), strict=True)
            link = "stream" in label or "iperf3" in label
            ax.plot(xs, ys, linestyle="--" if link else "-", marker="." if link else "o",
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{mode} ids")
        ax.set_xlabel("request MiB")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small")
    axes[0][0].set_ylabel("GB/s")
    fig.suptitle("READ across two namespaces (veth, UCX tcp) vs the same run's TCP stream")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    args.iperf3 = shutil.which("iperf3") is not None and not args.no_iperf3
    why = netns.unavailable()
    if why:
        raise argparse.ArgumentTypeError(f"cannot build namespaces: {why}")
    args.modes = ["contiguous", "scattered"] if args.ids == "both" else [args.ids]
    if args.num_blocks is None:
        args.num_blocks = max(1024, 2 * (max(args.sizes_mib) << 20) // (64 << 10) + 512)
    variants = args.variant or [("default", {})]
    pair = netns.Pair().up()
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    try:
        if args.netem:
            pair.shape(delay_ms=args.netem[0], rate_mbit=args.netem[1])
        with tempfile.TemporaryDirectory(prefix="kvstage-tcp-link-") as tmp:
            pair.popen(pair.p, [sys.executable, "-m", "bench.tcp_link_client",
                                "--serve-stream", f"{netns.PREFILL_IP}:{STREAM_PORT}"],
                       env=netns.child_env(), log=os.path.join(tmp, "stream.log"))
            if args.iperf3:
                pair.popen(pair.p, ["iperf3", "-s", "-p", str(IPERF3_PORT)],
                           env=netns.child_env(), log=os.path.join(tmp, "iperf3.log"))
            for rnd in range(args.rounds):
                for name, env in variants:
                    print(f"round {rnd + 1}/{args.rounds}: {name} {env}", file=sys.stderr)
                    try:
                        doc = run_variant(pair, args, env, tmp, f"{name}-{rnd}")
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        # recorded, not fatal: a variant that crashes UCX is a finding
                        print(f"{name}: FAILED: {exc}", file=sys.stderr)
                        failed.append({"variant": name, "env": env, "round": rnd,
                                       "error": str(exc)})
                        continue
                    doc.update(variant=name, env=env, round=rnd)
                    results.append(doc)
    finally:
        pair.close()
    rows = summarize(results)
    print_table(rows, COLUMNS, markdown=True,
                title="READ across namespaces vs the same run's TCP stream")
    for res in results[: len(variants)]:
        print(f"{res['variant']}: decode {res['ucx']}; prefill {res['prefill_ucx']}")
    for f in failed:
        print(f"{f['variant']} {f['env']}: FAILED: {f['error']}")
    if args.json:
        write_json(args.json, config=vars(args), env=machine_info("cpu") | {
            "host": socket.gethostname()}, results=rows, raw=results, failed=failed)
        print(f"wrote {args.json}")
    if args.png:
        plot(args.png, rows)
        print(f"wrote {args.png}")
    bad = [r for res in results for r in res["rows"] if r["verified"] is False]
    return 1 if bad or failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_program(sys.modules[__name__], "python -m bench.tcp_link", argv)


if __name__ == "__main__":
    sys.exit(main())
