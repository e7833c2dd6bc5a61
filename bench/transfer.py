"""`python -m bench.transfer`: NIXL READ of one request, merged runs vs per-block descriptors.

Two processes: a `kvstage prefill` worker holds a registered block-major host buffer and
prefills the request (so the bytes read are the verifiable pattern); this process
registers its own host buffer and READs the same request three ways, over the same two
buffers. By default the prefill is a child on 127.0.0.1 (`PrefillProcess`); across
machines run ``python -m bench.transfer --listen HOST:PORT`` on the prefill host and
``python -m bench.transfer --connect HOST:PORT`` on the decode host (the same preset and
``--num-blocks`` on both). The methods:

- ``merged``: kvstage's descriptors, one per run of blocks (block-major host layout);
- ``per_block``: one per (tensor, plane, block), vLLM's granularity (one descriptor per
  region per block), region-major like its ``_compute_desc_ids``;
- ``one_large``: the same number of bytes as ONE descriptor (the bandwidth ceiling).

Iterations are interleaved (the method order rotates every iteration) after a
warm-up, and each sample times ``read`` (descriptor lists built, READ posted; with CMA
the bytes move inside the call) until the poll says DONE. Reported: descriptors, MiB,
median ms, GB/s and % of the one-large-descriptor GB/s. ``contiguous`` ids come from
fresh pools on both sides; ``scattered`` ids from churned pools (allocate/free cycles,
as in vLLM's free queue). ``merged`` and ``per_block`` are verified byte-exact once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench import pipeline
from bench.posting import POSTING_COLUMNS, posting
from bench.transfer_bench import BENCH_LEASE_S, METHODS, Bench
from kvstage.bench.report import Column, format_bytes, machine_info, print_table, ratio, write_json
from kvstage.blocks import BlockPool, request_blocks
from kvstage.cache import HostLayout
from kvstage.cli import args as cli_args
from kvstage.cli import memory, net, run_program
from kvstage.cli.args import number, positive
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd.decode import pair_runs
from kvstage.presets import PRESETS, preset

ID_MODES = ("contiguous", "scattered")
SEEDS = {"contiguous": 101, "scattered": 202}
# churn: fill the pool with small allocations, then free this fraction in random order
CHURN_FREE = 0.55
CHURN_TOKENS = (16, 160)  # prefill churn requests: 1..10 blocks per group
DEFAULT_NUM_BLOCKS = 2048
MAX_TOKENS = 1 << 24  # as `kvstage decode`; the pool check refuses far less


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--preset", choices=sorted(PRESETS), default="gemma-3-1b")
    a("--tokens", type=positive(int, "--tokens", high=MAX_TOKENS), default=8192,
      help="prompt length (default 8192)")
    a("--num-blocks", type=number(int, "--num-blocks", low=2, inclusive=True), default=None,
      help=f"pool size on both sides (default {DEFAULT_NUM_BLOCKS}: room for the request "
      "and the churn; with --pipeline: sized from the largest --sizes-mib)")
    a("--ids", choices=(*ID_MODES, "both"), default="both")
    a("--iters", type=positive(int, "--iters", high=10**6), default=None,
      help="timed iterations (default 30)")
    a("--warmup", type=number(int, "--warmup", inclusive=True, high=10**6), default=None,
      help="untimed iterations first (default 5)")
    a("--json", default=None, metavar="PATH")
    a("--markdown", action="store_true", help="print the table as GitHub markdown")
    a("--quick", action="store_true", help="3 iterations, 1 warm-up: CI smoke")
    a("--seed", type=number(int, "--seed", inclusive=True), default=0, help="churn randomness")
    a("--listen", default=None, metavar="HOST:PORT",
      type=cli_args.address("--listen", listen=True),
      help="serve the prefill side here until stopped (run --connect on the other host)")
    a("--connect", default=None, metavar="HOST:PORT",
      type=cli_args.address("--connect", listen=False),
      help="measure against a `bench transfer --listen` prefill there, not a local child")
    cli_args.add_ucx_arguments(parser)
    cli_args.add_auth_arguments(parser)
    pipeline.add_arguments(a)


def _churn_local(layout: KVLayout, seed: int) -> BlockPool:
    """A decode pool after a busy period: filled with small allocations (1..8 blocks),
    then a random 55% of them freed in random order, so the free queue hands out
    pieces of 1..8 ids."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(layout.num_blocks)
    held: list[list[int]] = []
    while pool.num_free > 8:
        held.append(pool.allocate(int(rng.integers(1, 9))))
    for i in rng.permutation(len(held))[: int(CHURN_FREE * len(held))]:
        pool.free(held[i])
    return pool


def _ids(bench: Bench, mode: str, tokens: int, seed: int) -> tuple[list[list[int]],
                                                                   list[list[int]]]:
    """(remote ids, local ids) of the request in ``mode``."""
    lay = bench.layout
    if mode == "contiguous":
        local_pool = BlockPool(lay.num_blocks)
    else:
        # churn the prefill pool over its side channel: small prompts until it is nearly
        # full, then release a random 55% of them in random order
        rng = np.random.default_rng(seed + 1)
        stats = bench.client.call(m.GetStats())
        assert isinstance(stats, m.Stats)
        free, churn = stats.free_blocks, list[str]()
        while True:
            t = int(rng.integers(CHURN_TOKENS[0], CHURN_TOKENS[1] + 1))
            need = sum(request_blocks(lay, t))
            if need > free:
                break
            churn.append(f"churn-{mode}-{len(churn)}")
            bench.prefill(churn[-1], t, seed=1000 + len(churn))
            free -= need
        for i in rng.permutation(len(churn))[: int(CHURN_FREE * len(churn))]:
            bench.release(churn[i])
        local_pool = _churn_local(lay, seed + 2)
    remote = bench.prefill(f"bench-{mode}", tokens, SEEDS[mode])
    local = [local_pool.allocate(len(g)) for g in remote]
    return remote, local


def measure(bench: Bench, mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    remote_ids, local_ids = _ids(bench, mode, args.tokens, args.seed)
    runs = pair_runs(remote_ids, local_ids)
    descs = {meth: bench.descriptors(meth, runs) for meth in METHODS}
    nbytes = {meth: int(d[0][:, 1].sum()) for meth, d in descs.items()}
    assert len(set(nbytes.values())) == 1, nbytes  # the same bytes every way
    samples: dict[str, list[int]] = {meth: [] for meth in METHODS}
    for it in range(args.warmup + args.iters):
        k = it % len(METHODS)
        for meth in METHODS[k:] + METHODS[:k]:  # rotate: no method always goes first
            ns = bench.read_once(*descs[meth])
            if it >= args.warmup:
                samples[meth].append(ns)
    verified = {meth: bench.verify(descs[meth], local_ids, SEEDS[mode])
                for meth in ("merged", "per_block")}
    bench.posting_rows += posting(bench, mode, runs, local_ids, max(args.iters, 20),
                                  SEEDS[mode])
    rows: list[dict[str, Any]] = []
    for meth in METHODS:
        med_ns = statistics.median(samples[meth])
        rows.append({
            "ids": mode, "method": meth, "descriptors": len(descs[meth][0]),
            "blocks": int(runs[:, 2].sum()), "runs": int(runs.shape[0]),
            "nbytes": nbytes[meth], "mib": nbytes[meth] / 2**20,
            "median_ms": med_ns / 1e6, "min_ms": min(samples[meth]) / 1e6,
            "gbps": nbytes[meth] / med_ns, "samples": len(samples[meth]),
            "verified": verified.get(meth),
        })
    large = rows[-1]["gbps"]
    per_block_ms = rows[1]["median_ms"]
    for r in rows:
        r["pct_of_one_large"] = 100 * (ratio(r["gbps"], large) or 0.0)
        r["speedup_vs_per_block"] = ratio(per_block_ms, r["median_ms"])
    return rows


COLUMNS = [
    Column("ids", "ids", align="<"),
    Column("method", "descriptors", align="<"),
    Column("descriptors", "count"),
    Column("runs", "runs"),
    Column("mib", "MiB", "{:.1f}"),
    Column("median_ms", "median ms", "{:.2f}"),
    Column("gbps", "GB/s", "{:.2f}"),
    Column("pct_of_one_large", "% of one large", "{:.0f}%"),
    Column("speedup_vs_per_block", "x per-block", "{:.2f}x"),
    Column("verified", "bytes", lambda v: "verified" if v else "MISMATCH", align="<"),
]


def check_sizes(args: argparse.Namespace) -> None:
    """Refuse (ArgumentTypeError: one line, exit 2) a request the pool cannot hold, and
    pools that do not fit in the free memory: this process's cache and host buffer, and
    the local prefill child's (without --connect), before anything is allocated."""
    lay = preset(args.preset, num_blocks=args.num_blocks)
    need = sum(request_blocks(lay, args.tokens)) + 1
    if need > lay.num_blocks:
        raise argparse.ArgumentTypeError(
            f"--tokens {args.tokens} needs {need} {args.preset} blocks (every group, the null "
            f"block), more than --num-blocks {args.num_blocks}; lower --tokens or raise "
            "--num-blocks")
    pools = 2 if args.connect else 4
    memory.check_fits(
        f"--num-blocks {args.num_blocks} ({args.preset}, {memory.gib(lay.pool_bytes)} per "
        f"pool, {pools} pools {'here' if args.connect else 'here and in the prefill child'})",
        pools * lay.pool_bytes, "lower --num-blocks")


def _serve(args: argparse.Namespace) -> int:
    """``--listen``: the prefill role with the bench's layout and a lease that outlives it."""
    from kvstage.cli import prefill

    parser = argparse.ArgumentParser(prog="kvstage prefill")
    prefill.add_arguments(parser)  # the prefill role's own defaults for everything else
    argv = ["--listen", args.listen, "--lease-s", str(BENCH_LEASE_S), "--preset", args.preset,
            "--num-blocks", str(args.num_blocks), "--host-layout", HostLayout.BLOCK_MAJOR.value,
            "--device", "cpu", "--transport", "nixl"]
    for flag, value in (("--ucx-tls", args.ucx_tls), ("--ucx-net-devices", args.ucx_net_devices),
                        ("--ucx-tcp-seg-size", args.ucx_tcp_seg_size),
                        ("--key-file", args.key_file)):
        if value:
            argv += [flag, value]
    if args.insecure:
        argv.append("--insecure")
    return prefill.run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.listen and args.connect:
        raise argparse.ArgumentTypeError(
            "--listen serves the prefill side and --connect measures against one: pass one "
            "of them (or neither, for a local child)")
    args.transport = "nixl"  # cli_args.setup_ucx reads it
    if args.pipeline:
        return pipeline.run(args)
    args.num_blocks = args.num_blocks or DEFAULT_NUM_BLOCKS
    if args.listen:
        return _serve(args)
    check_sizes(args)
    if args.quick:
        args.iters = args.iters or 3
        args.warmup = 1 if args.warmup is None else args.warmup
    args.iters = args.iters or 30
    args.warmup = 5 if args.warmup is None else args.warmup
    modes = list(ID_MODES) if args.ids == "both" else [args.ids]
    try:
        bench = Bench(args)
    except (net.PeerUnavailable, argparse.ArgumentTypeError) as exc:  # or a key refused
        print(f"python -m bench.transfer: {exc}", file=sys.stderr)
        return net.EXIT_UNUSABLE_PEER
    try:
        lay = bench.layout
        where = (f"from {args.connect}" if args.connect
                 else "between two processes on 127.0.0.1")
        print(f"python -m bench.transfer: {lay.name} ({lay.num_groups} groups, "
              f"{lay.num_tensors} tensors x {lay.num_planes} plane, "
              f"{format_bytes(lay.block_bytes)} per block), {args.tokens}-token request, "
              f"NIXL READ {where} ({bench.ucx}); median of {args.iters} "
              f"interleaved iterations after {args.warmup} warm-up\n", flush=True)
        rows: list[dict[str, Any]] = []
        for i, mode in enumerate(modes):
            if i:
                bench.release(f"bench-{modes[i - 1]}")  # room for the next request
            rows += measure(bench, mode, args)
    finally:
        bench.close()
    print_table(rows, COLUMNS, markdown=args.markdown,
                title="" if args.markdown else "NIXL READ of one request")
    print_table(bench.posting_rows, POSTING_COLUMNS, markdown=args.markdown,
                title="READ posting cost per request (median us, nothing transferred)")
    for mode in modes:
        by = {r["method"]: r for r in rows if r["ids"] == mode}
        merged = by["merged"]
        print(f"{mode}: merged runs {merged['pct_of_one_large']:.0f}% of one large "
              f"descriptor's GB/s; {merged['speedup_vs_per_block']:.2f}x faster than "
              f"{by['per_block']['descriptors']} per-block descriptors "
              f"({merged['descriptors']} instead)")
    if args.json:
        write_json(args.json, config=vars(args), env=machine_info("cpu"), results=rows,
                   posting=bench.posting_rows)
        print(f"wrote {args.json}")
    return 0 if all(r["verified"] is not False for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.transfer ARGS`: one-line errors and exit 2 for bad input, as `kvstage`."""
    return run_program(sys.modules[__name__], "python -m bench.transfer", argv)


if __name__ == "__main__":
    sys.exit(main())
