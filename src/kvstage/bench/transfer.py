"""`kvstage bench transfer`: NIXL READ of one request, merged runs vs per-block descriptors.

Two processes: a `kvstage prefill` worker holds a registered block-major host buffer and
prefills the request (so the bytes read are the verifiable pattern); this process
registers its own host buffer and READs the same request three ways, over the same two
buffers. By default the prefill is a child on 127.0.0.1 (`PrefillProcess`); across
machines run ``kvstage bench transfer --listen HOST:PORT`` on the prefill host and
``kvstage bench transfer --connect HOST:PORT`` on the decode host (the same preset and
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
import contextlib
import statistics
import sys
import time
import uuid
from typing import Any

import numpy as np

from kvstage.bench import pipeline
from kvstage.bench.posting import POSTING_COLUMNS, posting
from kvstage.bench.report import Column, format_bytes, machine_info, print_table, ratio, write_json
from kvstage.blocks import BlockPool, GroupedBlockIds, request_blocks
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.cli import args as cli_args
from kvstage.cli import net
from kvstage.engine import CopyEngine
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd.decode import pair_runs
from kvstage.pd.side_channel import SideChannelClient, parse_address
from kvstage.presets import PRESETS, preset
from kvstage.testing.pattern import verify_request
from kvstage.transport.base import TransferState, Transport, wait

METHODS = ("merged", "per_block", "one_large")
ID_MODES = ("contiguous", "scattered")
SEEDS = {"contiguous": 101, "scattered": 202}
# churn: fill the pool with small allocations, then free this fraction in random order
CHURN_FREE = 0.55
CHURN_TOKENS = (16, 160)  # prefill churn requests: 1..10 blocks per group
READ_TIMEOUT_S = 30.0
NOTIF = b"kvstage-bench-transfer"  # not a request id: prefill counts it as unknown
# the bench holds its request for every iteration: a lease that outlives any run
BENCH_LEASE_S = 3600.0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--preset", choices=sorted(PRESETS), default="gemma-3-1b")
    a("--tokens", type=_positive_int, default=8192, help="prompt length (default 8192)")
    a("--num-blocks", type=_positive_int, default=2048,
      help="pool size on both sides (default 2048: room for the request and the churn)")
    a("--ids", choices=(*ID_MODES, "both"), default="both")
    a("--iters", type=_positive_int, default=None, help="timed iterations (default 30)")
    a("--warmup", type=int, default=None, help="untimed iterations first (default 5)")
    a("--json", default=None, metavar="PATH")
    a("--markdown", action="store_true", help="print the table as GitHub markdown")
    a("--quick", action="store_true", help="3 iterations, 1 warm-up: CI smoke")
    a("--seed", type=int, default=0, help="churn randomness")
    a("--listen", default=None, metavar="HOST:PORT",
      help="serve the prefill side here until stopped (run --connect on the other host)")
    a("--connect", default=None, metavar="HOST:PORT",
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


class Bench:
    """The prefill child, our host buffer and NIXL agent, and the remote's address."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvstage.testing.servers import PrefillProcess  # spawns a child: only when run

        self.args = args
        self.layout = preset(args.preset, num_blocks=args.num_blocks)
        self.host = HostBuffer(self.layout, HostLayout.BLOCK_MAJOR)
        self.cache = KVCache(self.layout, "cpu")
        self.engine = CopyEngine(self.cache, self.host)
        self.proc: PrefillProcess | None = None
        if args.connect:
            self.address = parse_address(args.connect)
            net.probe(*self.address)  # refused / unreachable: a clear error, no wait
        else:
            self.proc = PrefillProcess(self.layout, transport="nixl", lease_s=BENCH_LEASE_S)
            self.address = self.proc.wait_ready()
        self.ucx = cli_args.setup_ucx(args, self.address[0])
        self.transport: Transport | None = None
        # request ids prefill holds for us -> their capability: released at close
        self.held: dict[str, bytes] = {}
        self.tag = uuid.uuid4().hex[:8]  # a listener outlives runs: wire ids unique per run
        self.posting_rows: list[dict[str, Any]] = []
        try:
            key = cli_args.key_from_args(args, self.address[0], "bench transfer")
            self.client = SideChannelClient(*self.address, timeout_s=30.0, key=key)
            from kvstage.transport import make_transport

            self.transport = make_transport("nixl", f"bench-{uuid.uuid4().hex[:8]}")
            self.transport.register(self.host.data_ptr, self.host.nbytes)
            meta = self.client.call(m.GetMeta(engine_id=self.transport.name))
            assert isinstance(meta, m.Meta)
            self.layout.check_compatible(m.layout_from_msg(meta.layout))
            if meta.host_layout != HostLayout.BLOCK_MAJOR.value:
                raise ValueError(f"prefill host layout is {meta.host_layout}, need block_major")
            self.peer = self.transport.add_peer(meta.agent_metadata)
            self.shift = meta.host_base - self.host.data_ptr
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        try:
            if self.proc is None:  # a remote listener: give back what this run holds there
                for rid in sorted(self.held):
                    with contextlib.suppress(Exception):
                        self.release(rid)
            if self.transport is not None:
                self.transport.close()
        finally:
            if self.proc is not None:  # the child goes whatever failed above
                self.proc.stop()

    def prefill(self, rid: str, tokens: int, seed: int) -> list[list[int]]:
        wire = f"{rid}-{self.tag}"
        done = self.client.call(m.PrefillRequest(request_id=wire, num_tokens=tokens, seed=seed))
        if not isinstance(done, m.PrefillDone):
            raise RuntimeError(f"prefill refused request {wire!r}: {done}")
        self.held[rid] = done.capability
        return done.block_ids

    def release(self, rid: str) -> None:
        capability = self.held.pop(rid, b"")
        self.client.call(m.Release(request_id=f"{rid}-{self.tag}", capability=capability))

    # -- descriptor lists -----------------------------------------------------------------
    def descriptors(self, method: str, runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) ``[N, 2]`` for one method; ``runs`` is ``[R, 3]`` (src, dst, n)."""
        lay, host = self.layout, self.host
        if method == "merged":
            local = host.descriptors(runs[:, 1], runs[:, 2])
            remote = host.descriptors(runs[:, 0], runs[:, 2])
        elif method == "per_block":
            src = np.concatenate([np.arange(s, s + n) for s, _, n in runs])
            dst = np.concatenate([np.arange(d, d + n) for _, d, n in runs])
            regions = lay.num_tensors * lay.num_planes
            plane = lay.page_size_bytes // lay.num_planes
            # block-major row = [T, P, E]: region r of block b is at b * row + r * plane
            offs = np.arange(regions, dtype=np.int64)[:, None] * plane

            def rows(blocks: np.ndarray) -> np.ndarray:
                addr = (host.data_ptr + blocks[None, :] * lay.block_bytes + offs).reshape(-1)
                return np.stack((addr, np.full_like(addr, plane)), axis=1)

            local, remote = rows(dst), rows(src)
        elif method == "one_large":
            nblocks = int(runs[:, 2].sum())
            one = np.array([[1], [nblocks]], dtype=np.int64)  # blocks [1, 1 + n)
            local = host.descriptors(one[0], one[1])
            remote = local.copy()
        else:
            raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
        remote = remote.copy()
        remote[:, 0] += self.shift
        return local.astype(np.int64), remote.astype(np.int64)

    def read_once(self, local: np.ndarray, remote: np.ndarray) -> int:
        """One READ to DONE; returns its nanoseconds (raises if it did not finish)."""
        assert self.transport is not None
        start = time.perf_counter_ns()
        handle = self.transport.read(self.peer, local, remote, NOTIF)
        state = wait(self.transport, handle, READ_TIMEOUT_S, poll_interval_s=0.0)
        elapsed = time.perf_counter_ns() - start
        self.transport.release(handle)
        if state is not TransferState.DONE:
            raise RuntimeError(f"READ of {len(local)} descriptors ended {state.value}")
        return elapsed

    def verify(self, descs: tuple[np.ndarray, np.ndarray], local_ids: list[list[int]],
               seed: int) -> bool:
        """Zero our host buffer, READ once, load to the cache, compare every byte."""
        self.host.storage.zero_()
        self.read_once(*descs)
        self.engine.load_to_device(GroupedBlockIds(local_ids, self.layout))
        return verify_request(self.cache, local_ids, seed) == []


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


def _serve(args: argparse.Namespace) -> int:
    """``--listen``: the prefill role with the bench's layout and a lease that outlives it."""
    from kvstage.cli import prefill

    parser = argparse.ArgumentParser(prog="kvstage prefill")
    prefill.add_arguments(parser)  # the prefill role's own defaults for everything else
    argv = ["--listen", args.listen, "--lease-s", str(BENCH_LEASE_S), "--preset", args.preset,
            "--num-blocks", str(args.num_blocks), "--host-layout", HostLayout.BLOCK_MAJOR.value,
            "--device", "cpu", "--transport", "nixl"]
    for flag, value in (("--ucx-tls", args.ucx_tls), ("--ucx-net-devices", args.ucx_net_devices),
                        ("--key-file", args.key_file)):
        if value:
            argv += [flag, value]
    if args.insecure:
        argv.append("--insecure")
    return prefill.run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.listen and args.connect:
        raise SystemExit("--listen serves the prefill side and --connect measures against "
                         "one: pass one of them (or neither, for a local child)")
    args.transport = "nixl"  # cli_args.setup_ucx reads it
    if args.pipeline:
        return pipeline.run(args)
    if args.listen:
        parse_address(args.listen)
        return _serve(args)
    if args.quick:
        args.iters = args.iters or 3
        args.warmup = 1 if args.warmup is None else args.warmup
    args.iters = args.iters or 30
    args.warmup = 5 if args.warmup is None else args.warmup
    if args.warmup < 0:
        raise SystemExit("--warmup must be >= 0")
    modes = list(ID_MODES) if args.ids == "both" else [args.ids]
    try:
        bench = Bench(args)
    except (net.PeerUnavailable, argparse.ArgumentTypeError) as exc:  # or a key refused
        print(f"kvstage bench transfer: {exc}", file=sys.stderr)
        return net.EXIT_UNUSABLE_PEER
    try:
        lay = bench.layout
        where = (f"from {args.connect}" if args.connect
                 else "between two processes on 127.0.0.1")
        print(f"kvstage bench transfer: {lay.name} ({lay.num_groups} groups, "
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
