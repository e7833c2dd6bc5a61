"""Measure NIXL READ throughput between two processes on this host (loopback).

A spawned server registers ``--mib`` MiB; this process registers as much and READs it
all, cut into descriptors of each size, in a scattered order (a permutation on the
remote side, as real KV blocks are, so adjacent descriptors cannot merge). Each size
is warmed up, then timed ``--repeats`` times from ``read()`` to DONE; the table shows
the median. GB/s is 1e9 bytes/s.

    .venv/bin/python scripts/nixl_probe.py [--mib 64] [--repeats 5] [--num-threads 2]
    UCX_TLS=tcp .venv/bin/python scripts/nixl_probe.py   # without CMA, for comparison
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from kvstage.transport import TransferState, wait
from kvstage.transport.nixl import NixlTransport

KIB, MIB = 1 << 10, 1 << 20
SIZES = [0, 256 * KIB, 32 * KIB, 16 * KIB, 4 * KIB]  # 0: the whole buffer, 1 descriptor


def serve(conn: Connection, nbytes: int, num_threads: int) -> None:
    with NixlTransport("probe-server", num_threads=num_threads) as server:
        buf = torch.ones(nbytes, dtype=torch.uint8)
        server.register_tensor(buf)
        conn.send((server.metadata(), buf.data_ptr()))
        while not conn.poll(0.01):
            server.get_notifs()  # drain, as a real prefill worker would


def descriptors(base: int, size: int, order: np.ndarray) -> np.ndarray:
    """[N, 2] descriptors of ``size`` bytes at ``base + order * size``."""
    return np.stack([base + order * size, np.full(len(order), size)], axis=1).astype(np.int64)


def time_read(client: NixlTransport, peer: str, local: np.ndarray, remote: np.ndarray) -> float:
    t0 = time.perf_counter()
    handle = client.read(peer, local, remote, b"probe")
    state = wait(client, handle, timeout_s=60)
    elapsed = time.perf_counter() - t0
    client.release(handle)
    if state is not TransferState.DONE:
        raise RuntimeError(f"READ ended {state.value}: {client.failure_reason(handle)}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=2, help="NixlTransport's default")
    args = parser.parse_args()
    nbytes = args.mib * MIB
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, nbytes, args.num_threads), daemon=True)
    proc.start()
    try:
        with NixlTransport("probe-client", num_threads=args.num_threads) as client:
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            client.register_tensor(dst)
            metadata, remote_addr = conn.recv()
            peer = client.add_peer(metadata)
            rng = np.random.default_rng(0)
            one = np.zeros(1, dtype=np.int64)
            first = time_read(
                client,
                peer,
                descriptors(dst.data_ptr(), 4 * KIB, one),
                descriptors(remote_addr, 4 * KIB, one),
            )
            print(f"first READ (4 KiB, includes connection set-up): {first * 1e3:.1f} ms")
            print(
                f"{args.mib} MiB per READ, median of {args.repeats}, num_threads={args.num_threads}"
            )
            print(f"{'descriptor':>10} {'count':>7} {'median ms':>10} {'GB/s':>6} {'best GB/s':>9}")
            for size in SIZES:
                size = size or nbytes
                n = nbytes // size
                local = descriptors(dst.data_ptr(), size, np.arange(n))
                remote = descriptors(remote_addr, size, rng.permutation(n))
                for _ in range(2):  # warm-up: registration caches, page faults on dst
                    time_read(client, peer, local, remote)
                times = [time_read(client, peer, local, remote) for _ in range(args.repeats)]
                med, best = statistics.median(times), min(times)
                label = f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"
                print(
                    f"{label:>10} {n:>7} {med * 1e3:>10.2f} {nbytes / med / 1e9:>6.2f} "
                    f"{nbytes / best / 1e9:>9.2f}"
                )
    finally:
        conn.send("quit")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
