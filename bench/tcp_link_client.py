"""The decode side of `python -m bench.tcp_link`: one process in the decode namespace that
alternates, per request size and id mode, a plain TCP stream of the request's bytes and
kvstage's READ of the request, so the link rate and the READ share every disturbance.

Also the stream's server (``--serve-stream HOST:PORT``, run in the prefill namespace): it
reads an 8-byte length and ``sendall``s that many bytes from one preallocated buffer, on one
connection kept open for the run (a warm TCP window, as the READ's UCX connection is).

The READ ``methods``: ``read`` posts the request as ONE transfer of merged descriptors
(`bench.transfer`'s ``merged``) and waits for DONE, polling without pause; ``split<k>``
cuts the same runs into ``k`` chunks (`kvstage.pd.pipeline.split_runs`) posted at once,
waiting for all; ``pipeline`` is the product's path, the request through
`kvstage.pd.pipeline` as `DecodeWorker(pipeline=True)` (the vLLM connector's) posts it:
its chunks, its window, a poll every 0.5 ms, h2d behind (to a CPU cache here). Every
sample is the time to the last byte READ.
Results: one JSON document on stdout's last line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.transfer import _churn_local
from bench.transfer_bench import NOTIF, Bench
from kvstage.blocks import BlockPool, request_blocks
from kvstage.pd import messages as m
from kvstage.pd import pipeline
from kvstage.pd.decode import pair_runs
from kvstage.pd.pipeline import Loader, ReadJob, split_runs
from kvstage.transport.base import TransferState

CHUNK = 8 << 20  # the stream server's buffer; a request is sent as many of these
TIMEOUT_S = 60.0
CHURN_TOKENS = (16, 160)


def serve_stream(address: str) -> None:
    host, port = address.rsplit(":", 1)
    buf = memoryview(bytearray(CHUNK))
    with socket.create_server((host, int(port))) as srv:
        while True:
            conn, _ = srv.accept()
            with conn:
                while True:
                    head = conn.recv(8, socket.MSG_WAITALL)
                    if len(head) < 8:
                        break
                    (n,) = struct.unpack("!Q", head)
                    while n > 0:
                        k = min(n, CHUNK)
                        conn.sendall(buf[:k])
                        n -= k


class Stream:
    def __init__(self, host: str, port: int, max_bytes: int) -> None:
        self.sock = socket.create_connection((host, port), timeout=TIMEOUT_S)
        self.buf = memoryview(bytearray(min(max_bytes, CHUNK)))

    def once(self, nbytes: int) -> int:
        """Nanoseconds from asking for ``nbytes`` to the last of them received."""
        start = time.perf_counter_ns()
        self.sock.sendall(struct.pack("!Q", nbytes))
        left = nbytes
        while left:
            got = self.sock.recv_into(self.buf, min(left, len(self.buf)))
            if not got:
                raise RuntimeError("the stream server closed the connection")
            left -= got
        return time.perf_counter_ns() - start


def iperf3(host: str, port: int, seconds: float = 1.0) -> float | None:
    """GB/s of one ``iperf3 -R`` run (the server in the prefill namespace sends), or None
    without iperf3."""
    if shutil.which("iperf3") is None:
        return None
    out = subprocess.run(["iperf3", "-c", host, "-p", str(port), "-R", "-t", str(seconds),
                          "-J"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return None
    return float(json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"]) / 8e9


def tokens_for(layout: Any, nbytes: int) -> int:
    """The smallest prompt whose blocks reach ``nbytes`` (bisection)."""
    lo, hi = 1, 1 << 24
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(request_blocks(layout, mid)) * layout.block_bytes >= nbytes:
            hi = mid
        else:
            lo = mid + 1
    return lo


def churn_remote(bench: Bench, seed: int) -> None:
    """Fill the prefill pool with small requests, release a random 55 % of them."""
    rng = np.random.default_rng(seed)
    stats = bench.client.call(m.GetStats())
    assert isinstance(stats, m.Stats)
    free, held = stats.free_blocks, list[str]()
    while True:
        t = int(rng.integers(CHURN_TOKENS[0], CHURN_TOKENS[1] + 1))
        need = sum(request_blocks(bench.layout, t))
        if need > free:
            break
        held.append(f"churn-{len(held)}")
        bench.prefill(held[-1], t, seed=1000 + len(held))
        free -= need
    for i in rng.permutation(len(held))[: int(0.55 * len(held))]:
        bench.release(held[i])


def wait_all(bench: Bench, handles: list[int], poll_s: float) -> None:
    assert bench.transport is not None
    deadline = time.monotonic() + TIMEOUT_S
    left = list(handles)
    while left:
        left = [h for h in left if bench.transport.poll(h) is TransferState.PENDING]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(left)} READs still pending after {TIMEOUT_S} s")
        if left and poll_s:
            time.sleep(poll_s)
    for h in handles:
        state = bench.transport.poll(h)
        bench.transport.release(h)
        if state is not TransferState.DONE:
            raise RuntimeError(f"a READ ended {state.value}")


def cut(descs: np.ndarray, pieces: int) -> np.ndarray:
    """``[N, 2]`` (addr, nbytes) rows cut so that none is over ``total / pieces`` bytes."""
    most = max(1, -(-int(descs[:, 1].sum()) // pieces))
    rows = []
    for addr, n in descs.tolist():
        for off in range(0, n, most):
            rows.append((addr + off, min(most, n - off)))
    return np.array(rows, dtype=np.int64)


def read_cut(bench: Bench, runs: np.ndarray, pieces: int, poll_s: float) -> int:
    """One transfer whose descriptors are cut into at least ``pieces`` (NIXL's UCX thread
    pool spreads a descriptor list over its workers, each its own TCP connection)."""
    assert bench.transport is not None
    local, remote = bench.descriptors("merged", runs)
    local, remote = cut(local, pieces), cut(remote, pieces)
    start = time.perf_counter_ns()
    handle = bench.transport.read(bench.peer, local, remote, NOTIF)
    wait_all(bench, [handle], poll_s)
    return time.perf_counter_ns() - start


def read(bench: Bench, runs: np.ndarray, parts: int, poll_s: float) -> int:
    """One request's READ as ``parts`` concurrent transfers; nanoseconds to the last byte."""
    assert bench.transport is not None
    chunks = (split_runs(runs, bench.layout.block_bytes, min_chunk_bytes=1,
                         target_chunks=parts, max_chunks=parts) if parts > 1 else [runs])
    descs = [bench.descriptors("merged", c) for c in chunks]
    start = time.perf_counter_ns()
    handles = [bench.transport.read(bench.peer, loc, rem, NOTIF) for loc, rem in descs]
    wait_all(bench, handles, poll_s)
    return time.perf_counter_ns() - start


def read_pipelined(bench: Bench, runs: np.ndarray, loader: Loader, window: int = 0) -> int:
    """The product's READ (`DecodeWorker(pipeline=True)`): `split_runs` chunks, `ReadJob`
    posting and polling every 0.5 ms as the decode's ``wait`` does, h2d of each chunk
    behind; nanoseconds from the first post to the last chunk's READ seen DONE.
    ``window`` > 0 replaces the product's choice (`pipeline.window_for` the prefill's
    address: every chunk at once across hosts) of chunks in flight."""
    assert bench.transport is not None
    transport = bench.transport
    job = ReadJob(split_runs(runs, bench.layout.block_bytes), bench.peer, NOTIF,
                  post=lambda r, notif: transport.read(
                      bench.peer, *bench.descriptors("merged", r), notif),
                  verify=lambda r: "",
                  window=window or pipeline.window_for(bench.address[0]))
    t0 = time.monotonic()
    job.post_window()
    state = "pending"
    while state == "pending" and time.monotonic() - t0 < TIMEOUT_S:
        state, _ = job.advance(transport, loader)
        if state == "pending":
            time.sleep(0.0005)
    for h in job.handles_all():
        transport.release(h)
    if state != "done":
        raise RuntimeError(f"pipelined READ ended {state}")
    return int((job.read_done - t0) * 1e9)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(args)
    try:
        host, port = args.connect.rsplit(":", 1)
        stream = Stream(host, args.stream_port, max(args.sizes_mib) << 20)
        rows: list[dict[str, Any]] = []
        loader = Loader(bench.engine)
        for mode in args.modes:
            local_pool = BlockPool(bench.layout.num_blocks)
            if mode == "scattered":
                churn_remote(bench, args.seed)
                local_pool = _churn_local(bench.layout, args.seed + 2)
            for mib in args.sizes_mib:
                tokens = tokens_for(bench.layout, mib << 20)
                rid = f"req-{mode}-{mib}"
                remote = bench.prefill(rid, tokens, seed=7)
                local = [local_pool.allocate(len(g)) for g in remote]
                runs = pair_runs(remote, local)
                nbytes = int(runs[:, 2].sum()) * bench.layout.block_bytes
                link = [iperf3(host, args.iperf3_port)] if args.iperf3_port else []
                methods = ["stream", *args.methods]
                samples: dict[str, list[int]] = {k: [] for k in methods}
                for it in range(args.warmup + args.iters):
                    k = it % len(methods)
                    for meth in methods[k:] + methods[:k]:
                        if meth == "stream":
                            ns = stream.once(nbytes)
                        elif meth.startswith("pipeline"):  # pipelineW2: window of 2
                            window = meth.removeprefix("pipeline").removeprefix("W")
                            ns = read_pipelined(bench, runs, loader, int(window or 0))
                        elif meth.startswith("cut"):
                            ns = read_cut(bench, runs, int(meth.removeprefix("cut")),
                                          args.poll_s)
                        else:
                            parts = 1 if meth == "read" else int(meth.removeprefix("split"))
                            ns = read(bench, runs, parts, args.poll_s)
                        if it >= args.warmup:
                            samples[meth].append(ns)
                if args.iperf3_port:
                    link.append(iperf3(host, args.iperf3_port))
                verified = bench.verify(bench.descriptors("merged", runs), local, seed=7)
                for meth in methods:
                    med = float(np.median(samples[meth]))
                    rows.append({"ids": mode, "mib": nbytes / 2**20, "tokens": tokens,
                                 "runs": int(runs.shape[0]), "method": meth,
                                 "median_ms": med / 1e6, "gbps": nbytes / med,
                                 "samples_ms": [s / 1e6 for s in samples[meth]],
                                 "iperf3_gbps": [x for x in link if x is not None],
                                 "verified": verified if meth != "stream" else None})
                bench.release(rid)
                for g in local:
                    local_pool.free(g)
        loader.close()
        return {"rows": rows, "ucx": bench.ucx}
    finally:
        bench.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tcp_link_client")
    p.add_argument("--serve-stream", default=None, metavar="HOST:PORT")
    p.add_argument("--connect", default=None, metavar="HOST:PORT")
    p.add_argument("--stream-port", type=int, default=5701)
    p.add_argument("--iperf3-port", type=int, default=0, help="0: no iperf3 runs")
    p.add_argument("--preset", default="gemma-3-1b")
    p.add_argument("--num-blocks", type=int, default=16384)
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--modes", nargs="+", default=["contiguous", "scattered"])
    p.add_argument("--methods", nargs="+", default=["read"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--poll-s", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.serve_stream:
        serve_stream(args.serve_stream)
        return 0
    args.transport, args.ucx_tls, args.ucx_net_devices = "nixl", None, None
    args.ucx_tcp_seg_size = None
    args.key_file, args.insecure = None, False
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
