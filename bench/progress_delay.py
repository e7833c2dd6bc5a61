"""NIXL progress thread settings of the prefill: idle CPU, READ bandwidth and small-READ
latency (BENCHMARKS.md "What do idle instances cost?").

Three prefill children on 127.0.0.1 whose agents differ only in the progress thread:
``busy`` (NIXL's own ``pthrDelay = 0``), ``sleep`` (kvstage's default delay) and ``off``
(no thread; the serve loop's polls drive UCX). For each: its CPU share over a few idle
seconds (/proc/PID/stat), then READs by one decode (default transport settings), the
three prefills taking turns in rotating order: a large request (GB/s) and a one-block
request (ms from start to the h2d done). Every READ is byte-checked by the decode role.

    .venv/bin/python -m bench.progress_delay [--ucx-tls tcp] [--iters 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SETTINGS = {
    "busy": {"progress_thread": True, "progress_delay_us": 0},
    "sleep": {"progress_thread": True},
    "off": {"progress_thread": False},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for all (default: loopback's)")
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--idle-s", type=float, default=4.0)
    args = p.parse_args()
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    from kvstage.pd import messages as m
    from kvstage.presets import preset
    from kvstage.testing.cpu import idle_share
    from kvstage.testing.servers import PrefillProcess, make_decode

    lay = preset("llama-3.1-8b", num_blocks=96)
    procs = {k: PrefillProcess(lay, transport="nixl", lease_s=600.0, transport_options=v)
             for k, v in SETTINGS.items()}
    try:
        addrs = {k: pp.wait_ready() for k, pp in procs.items()}
        time.sleep(1.0)
        idle = {}
        for k, pp in procs.items():
            idle[k] = idle_share(pp.pid, args.idle_s)
        big = (args.mib << 20) // lay.block_bytes * lay.groups[0].spec.block_size
        small = lay.groups[0].spec.block_size
        gbps: dict[str, list[float]] = {k: [] for k in SETTINGS}
        lat: dict[str, list[float]] = {k: [] for k in SETTINGS}
        with make_decode(lay, transport="nixl", read_timeout_s=60.0) as decode:
            clients = {k: decode.client(*a) for k, a in addrs.items()}
            names = list(SETTINGS)
            for it in range(args.iters + 1):
                for j in range(len(names)):
                    k = names[(it + j) % len(names)]
                    for tokens, out in ((big, gbps), (small, lat)):
                        rid = f"{k}-{it}-{tokens}"
                        done = clients[k].call(m.PrefillRequest(
                            request_id=rid, num_tokens=tokens, seed=it), timeout_s=60.0)
                        assert isinstance(done, m.PrefillDone), done
                        res = decode.start(rid, addrs[k], done.block_ids,
                                           capability=done.capability)
                        res = decode.wait(rid, 60.0) if res.status == "pending" else res
                        assert res.ok, (rid, res.status, res.reason)
                        decode.finish(rid)
                        if it:  # the first round warms up
                            out[k].append(done.nbytes / res.read_s / 1e9 if out is gbps
                                          else res.decode_s * 1e3)
    finally:
        for pp in procs.values():
            pp.stop()
    tls = os.environ.get("UCX_TLS", "tcp,sm,self,cma (default)")
    print(f"UCX_TLS={tls}, {args.mib} MiB READ and 1-block READ, median of {args.iters}")
    print("| prefill progress thread | idle CPU % of a core | READ GB/s | 1-block decode ms |")
    print("|---|---:|---:|---:|")
    for k in SETTINGS:
        print(f"| {k} | {idle[k] * 100:.1f} | {statistics.median(gbps[k]):.2f} "
              f"| {statistics.median(lat[k]):.2f} |")


if __name__ == "__main__":
    main()
