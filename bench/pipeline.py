"""`python -m bench.transfer --pipeline`: d2h, READ, h2d and the decode time per request
size, sequential vs pipelined (`kvstage.pd.pipeline`), and the cost of checksums.

Two prefill children on 127.0.0.1 (`PrefillProcess`, real NIXL), one computing per-block
checksums (``verify_checksum``) and one not; one `DecodeWorker` in this process. Per size
and iteration, in rotating order, one request each way:

- ``sequential``: one READ, then the h2d (``pipeline=False``): its READ and h2d times are
  the phases, its decode time (READ posted -> last h2d done) their sum;
- ``pipelined``: chunks of runs, chunk k loaded while k+1 is in flight;
- ``pipelined+checksum``: the same from the checksumming prefill, decode verifying.

Reported per size (medians): d2h at prefill without and with hashing, READ, h2d,
decode time sequential / pipelined / with checksums, the ratios to max(READ, h2d), and
decode GB/s with and without checksums. Then, at prefill, the incremental-save overlap
(`bench.chunked`). ``--json`` (``results``, ``saves``) and ``--plot`` write them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench import chunked
from kvstage.bench.report import Column, machine_info, plot_lines, print_table, write_json
from kvstage.blocks import request_blocks
from kvstage.cli import memory
from kvstage.cli.args import positive
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker, RequestResult
from kvstage.pd.side_channel import SideChannelClient
from kvstage.presets import preset

MODES = ("sequential", "pipelined", "pipelined+checksum")
DEFAULT_SIZES_MIB = (8, 16, 32, 64, 128)
LEASE_S = 600.0
MAX_SIZE_MIB = 1 << 16  # 64 GiB: the memory check refuses far less on most machines
#: pools alive at once at the peak: two prefill children and the decode, a device pool
#: and a host buffer each (stopped before the incremental saves, which hold two)
POOLS = 6
COLUMNS = [
    Column("mib", "MiB", "{:.0f}"),
    Column("chunks", "chunks"),
    Column("d2h_ms", "d2h ms", "{:.1f}"),
    Column("d2h_hash_ms", "d2h+hash ms", "{:.1f}"),
    Column("read_ms", "READ ms", "{:.1f}"),
    Column("h2d_ms", "h2d ms", "{:.1f}"),
    Column("seq_ms", "seq ms", "{:.1f}"),
    Column("pipe_ms", "pipelined ms", "{:.1f}"),
    Column("seq_ratio", "seq/max", "{:.2f}"),
    Column("pipe_ratio", "pipe/max", "{:.2f}"),
    Column("gbps", "GB/s", "{:.2f}"),
    Column("gbps_checksum", "GB/s checksum", "{:.2f}"),
]


def add_arguments(a: Any) -> None:
    a("--pipeline", action="store_true",
      help="measure the decode pipeline instead (sizes: --sizes-mib; see bench/pipeline.py)")
    a("--sizes-mib", type=positive(int, "--sizes-mib", high=MAX_SIZE_MIB), nargs="+",
      default=list(DEFAULT_SIZES_MIB),
      help="--pipeline: request sizes in MiB (whole blocks of the preset)")
    a("--plot", default=None, metavar="PATH.png", help="--pipeline: write the plot here")
    a("--device", default="cpu", help="--pipeline: decode's device (cuda: copy stream)")
    a("--no-progress-thread", dest="progress_thread", action="store_false",
      help="--pipeline: decode's NIXL agent without its progress thread (which sleeps "
           "while idle); decode's polls then progress its READs")


def _one(decode: DecodeWorker, client: SideChannelClient, addr: tuple[str, int], rid: str,
         tokens: int, mode: str) -> tuple[m.PrefillDone, RequestResult]:
    done = client.call(m.PrefillRequest(request_id=rid, num_tokens=tokens, seed=len(rid)),
                       timeout_s=120.0)
    assert isinstance(done, m.PrefillDone)
    decode.pipeline = mode != "sequential"
    decode.verify_checksum = mode.endswith("checksum")
    res = decode.start(rid, addr, done.block_ids, capability=done.capability)
    deadline = time.monotonic() + 60.0
    while res.status == "pending" and time.monotonic() < deadline:
        decode.poll()
        time.sleep(0.0002)
    if not res.ok:
        raise RuntimeError(f"{rid} ({mode}) {res.status}: {res.reason}")
    decode.finish(rid)
    return done, res


def pool_blocks(layout: KVLayout, blocks: int) -> int:
    """Blocks a request of ``blocks`` blocks per group needs in a pool: the prefill's
    request (every group, sliding windows clipped) or the incremental saves (``blocks``
    in every group), whichever is more, plus the null block."""
    tokens = blocks * layout.block_size
    return max(sum(request_blocks(layout, tokens)), layout.num_groups * blocks) + 1


def resolve(args: argparse.Namespace) -> tuple[KVLayout, dict[int, int]]:
    """The layout and {MiB: blocks per group} of a ``--pipeline`` run, checked before
    anything starts (ArgumentTypeError: one line, exit 2). Without ``--num-blocks`` the
    pool is sized from the largest size; with it, a pool too small is refused. The
    pools must fit in the free memory (`memory.check_fits`)."""
    probe = preset(args.preset, num_blocks=2)
    blocks = {s: max(1, (s << 20) // probe.block_bytes) for s in sorted(set(args.sizes_mib))}
    top = max(blocks)
    need = pool_blocks(probe, blocks[top])
    if args.num_blocks is not None and args.num_blocks < need:
        raise argparse.ArgumentTypeError(
            f"--sizes-mib {top} needs a pool of {need} {args.preset} blocks "
            f"({probe.block_bytes} bytes each, every group and the incremental saves), got "
            f"--num-blocks {args.num_blocks}; raise --num-blocks or leave it out")
    lay = preset(args.preset, num_blocks=args.num_blocks or need)
    memory.check_fits(
        f"--sizes-mib {top} ({args.preset}, {lay.num_blocks}-block pools, {POOLS} of them "
        f"with their host buffers)", POOLS * lay.pool_bytes,
        "lower --sizes-mib or --num-blocks", device=args.device, device_bytes=0)
    return lay, blocks


def run(args: argparse.Namespace) -> int:
    from kvstage.testing.servers import PrefillProcess, make_decode  # children: only when run

    iters = 3 if args.quick else (args.iters or 7)
    warmup = 1 if args.quick else (2 if args.warmup is None else args.warmup)
    lay, blocks = resolve(args)
    sizes = sorted(blocks)
    plain = PrefillProcess(lay, transport="nixl", lease_s=LEASE_S)
    hashing = PrefillProcess(lay, transport="nixl", lease_s=LEASE_S, verify_checksum=True)
    rows: list[dict[str, Any]] = []
    try:
        addrs = {"plain": plain.wait_ready(), "hash": hashing.wait_ready()}
        with make_decode(lay, transport="nixl", device=args.device, read_timeout_s=60.0,
                         handshake_timeout_s=30.0,
                         transport_options={"progress_thread": args.progress_thread},
                         ) as decode:
            clients = {k: decode.client(*a) for k, a in addrs.items()}
            print(f"python -m bench.transfer --pipeline: {lay.name}, "
                  f"{lay.block_bytes >> 10} KiB blocks, decode on {args.device}, median of "
                  f"{iters} rotating iterations after {warmup} warm-up\n", flush=True)
            for size in sizes:
                tokens = blocks[size] * lay.block_size
                got: dict[str, list[tuple[m.PrefillDone, RequestResult]]] = {k: [] for k in MODES}
                for it in range(warmup + iters):
                    for j in range(len(MODES)):
                        mode = MODES[(it + j) % len(MODES)]
                        src = "hash" if mode.endswith("checksum") else "plain"
                        out = _one(decode, clients[src], addrs[src], f"p{size}-{it}-{j}",
                                   tokens, mode)
                        if it >= warmup:
                            got[mode].append(out)
                # the bytes the request moves: every group's blocks, windows clipped
                nbytes = lay.block_bytes * sum(request_blocks(lay, tokens))
                rows.append(_row(size, nbytes, got))
                print(f"  {size} MiB done", file=sys.stderr, flush=True)
    finally:
        plain.stop()
        hashing.stop()
    print_table(rows, COLUMNS, markdown=args.markdown,
                title="" if args.markdown else "decode time: sequential vs pipelined")
    saves = chunked.measure(lay, blocks, iters=iters, warmup=warmup, device=args.device)
    print_table(saves, chunked.COLUMNS, markdown=args.markdown,
                title="" if args.markdown else "incremental prefill saves: d2h hidden "
                "behind the next chunk's compute")
    if args.json:
        write_json(args.json, config=vars(args), env=machine_info(args.device), results=rows,
                   saves=saves)
    if args.plot:
        xs = [r["mib"] for r in rows]
        plot_lines(args.plot, {
            "decode time": {
                "sequential (READ + h2d)": (xs, [r["seq_ms"] for r in rows]),
                "pipelined": (xs, [r["pipe_ms"] for r in rows]),
                "pipelined + checksum": (xs, [r["check_ms"] for r in rows]),
                "max(READ, h2d)": (xs, [r["max_ms"] for r in rows]),
            },
            "prefill time, 4 chunks (compute stand-in + d2h)": {
                "sequential (save waits)": (xs, [r["seq_ms"] for r in saves]),
                "overlapped (save(wait=False))": (xs, [r["ovl_ms"] for r in saves]),
                "compute alone": (xs, [r["compute_ms"] for r in saves]),
            },
        }, xlabel="request MiB", ylabel="ms (median)", title=f"{lay.name} pipelining")
    return 0


def _row(size: int, nbytes: int,
         got: dict[str, list[tuple[m.PrefillDone, RequestResult]]]) -> dict[str, Any]:
    def med(mode: str, f: Any) -> float:
        return statistics.median(f(d, r) for d, r in got[mode]) * 1e3

    read = med("sequential", lambda d, r: r.read_s)
    h2d = med("sequential", lambda d, r: r.h2d_s)
    seq = med("sequential", lambda d, r: r.decode_s)
    pipe = med("pipelined", lambda d, r: r.decode_s)
    check = med("pipelined+checksum", lambda d, r: r.decode_s)
    top = max(read, h2d)
    return {
        "mib": size, "nbytes": nbytes, "chunks": got["pipelined"][0][1].num_chunks,
        "d2h_ms": med("sequential", lambda d, r: d.d2h_s),
        "d2h_hash_ms": med("pipelined+checksum", lambda d, r: d.d2h_s),
        "read_ms": read, "h2d_ms": h2d, "max_ms": top, "seq_ms": seq, "pipe_ms": pipe,
        "check_ms": check, "seq_ratio": seq / top, "pipe_ratio": pipe / top,
        "gbps": nbytes / pipe / 1e6, "gbps_checksum": nbytes / check / 1e6,
    }
