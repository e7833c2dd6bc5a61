"""`kvstage prefill --listen HOST:PORT` and `kvstage decode --connect HOST:PORT`.

The prefill role serves a worker until SIGINT/SIGTERM (then frees held requests,
deregisters memory and closes). The decode role asks the prefill side to run prompts
(standing in for the proxy that routes a request to prefill first), READs each one,
loads it to its device, verifies every byte, and prints one row per request plus a
summary (GB/s, p50/p99 latency per phase).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import FrameType
from typing import TextIO

from kvstage.cache import HostLayout
from kvstage.layout import KVLayout
from kvstage.pd import messages as m
from kvstage.pd import multihost
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.handshake import HandshakeTimeout, PeerError, parse_address
from kvstage.pd.prefill import DEFAULT_LEASE_S, PrefillWorker
from kvstage.presets import PRESETS, preset
from kvstage.testing.pattern import verify_request

DEFAULT_PORT = 5600
DEFAULT_BLOCKS = {"llama-3.1-8b": 192, "gpt-oss-20b": 768}


def _positive(kind: type, name: str) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {text}")
        return value

    return parse


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="gemma-3-1b", choices=sorted(PRESETS))
    p.add_argument("--num-blocks", type=_positive(int, "--num-blocks"), default=None,
                   help="blocks in the pool (default: 2048, fewer for large-page presets)")
    p.add_argument("--host-layout", default="block_major", choices=[h.value for h in HostLayout])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--transport", default="nixl", choices=["nixl", "loopback"])


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    blocks = args.num_blocks or DEFAULT_BLOCKS.get(args.preset, 2048)
    return preset(args.preset, num_blocks=blocks)


# -- prefill -------------------------------------------------------------------------------
def add_prefill_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}",
                   help="HOST:PORT of the side channel (port 0 picks a free one)")
    p.add_argument("--lease-s", type=_positive(float, "--lease-s"), default=DEFAULT_LEASE_S)
    add_layout_arguments(p)
    multihost.add_ucx_arguments(p)


def run_prefill(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen)
    ucx = multihost.setup_ucx(args, host)
    try:
        worker = PrefillWorker(
            layout_from_args(args), host=host, port=port, device=args.device,
            host_layout=HostLayout(args.host_layout), lease_s=args.lease_s,
            transport=args.transport,
        )
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"kvstage prefill: cannot start on {args.listen} ({ucx}): {exc}", file=sys.stderr)
        return multihost.EXIT_UNUSABLE_PEER

    def stop(signum: int, _frame: FrameType | None) -> None:
        worker.stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    h, p = worker.address
    lay = worker.layout
    print(f"kvstage prefill listening on {h}:{p} engine={worker.engine_id} preset={lay.name} "
          f"groups={lay.num_groups} tensors={lay.num_tensors} blocks={lay.num_blocks} "
          f"host={worker.host.nbytes >> 20} MiB", flush=True)
    print(f"kvstage prefill {ucx}", flush=True)
    try:
        worker.serve_forever()
    finally:
        s = worker.stats()
        worker.close()
        print(f"kvstage prefill stopped: prefilled={s.prefilled} completed={s.completed} "
              f"released={s.released} expired={s.expired} held_at_stop={s.held_requests}",
              flush=True)
    return 0


# -- decode --------------------------------------------------------------------------------
@dataclass
class Row:
    request: str
    layout: str
    tokens: int
    blocks: str
    nbytes: int
    descriptors: int
    d2h_ms: float
    read_ms: float
    h2d_ms: float
    status: str
    verified: bool
    reason: str = ""

    @property
    def gbps(self) -> float:
        return self.nbytes / (self.read_ms * 1e6) if self.read_ms > 0 else 0.0


def run_one(worker: DecodeWorker, addr: tuple[str, int], rid: str, tokens: int, seed: int,
            timeout_s: float) -> Row:
    client = worker.client(*addr)
    done = client.call(m.PrefillRequest(request_id=rid, num_tokens=tokens, seed=seed))
    assert isinstance(done, m.PrefillDone)
    res = worker.start(rid, addr, done.block_ids)
    if res.status == "pending":
        # the worker fails the READ at its own deadline; wait() is only the backstop
        res = worker.wait(rid, timeout_s + 1.0)
    problems = verify_request(worker.cache, res.local_block_ids, seed) if res.ok else []
    if res.ok:
        worker.finish(rid)
    return Row(
        request=rid, layout=worker.layout.name, tokens=tokens,
        blocks=_blocks(done.block_ids), nbytes=res.nbytes, descriptors=res.num_descriptors,
        d2h_ms=done.d2h_s * 1e3, read_ms=res.read_s * 1e3, h2d_ms=res.h2d_s * 1e3,
        status=res.status, verified=res.ok and not problems,
        reason=res.reason or ("; ".join(problems[:3]) if problems else ""),
    )


def _blocks(ids: list[list[int]]) -> str:
    """[33, 33, 33, 33, 33, 33, 512] -> '[33x6, 512]'."""
    out: list[str] = []
    counts = [len(g) for g in ids]
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        out.append(f"{counts[i]}x{j - i}" if j - i > 1 else str(counts[i]))
        i = j
    return "[" + ", ".join(out) + "]"


def print_rows(rows: list[Row], file: TextIO | None = None) -> None:
    file = file or sys.stdout  # at call time: sys.stdout may have been replaced
    head = (f"{'request':<14}{'layout':<14}{'tokens':>7} {'blocks/group':<16}{'MiB':>8}{'descs':>6}"
            f"{'d2h ms':>8}{'READ ms':>9}{'h2d ms':>8}{'READ GB/s':>10}  result")
    print(head, file=file)
    for r in rows:
        verdict = "ok, bytes verified" if r.verified else f"{r.status.upper()}: {r.reason}"
        print(f"{r.request:<14}{r.layout:<14}{r.tokens:>7} {r.blocks:<16}{r.nbytes / 2**20:>8.1f}"
              f"{r.descriptors:>6}{r.d2h_ms:>8.2f}{r.read_ms:>9.2f}{r.h2d_ms:>8.2f}"
              f"{r.gbps:>10.2f}  {verdict}", file=file)


def print_summary(rows: list[Row], file: TextIO | None = None) -> None:
    file = file or sys.stdout  # at call time: sys.stdout may have been replaced
    ok = [r for r in rows if r.verified]
    print(f"\n{len(ok)}/{len(rows)} requests verified byte-exact", file=file)
    if not ok:
        return
    total = sum(r.nbytes for r in ok)
    read_s = sum(r.read_ms for r in ok) / 1e3
    gbps = total / read_s / 1e9
    print(f"READ: {total / 2**20:.1f} MiB in {read_s * 1e3:.1f} ms = {gbps:.2f} GB/s", file=file)
    for phase in ("d2h_ms", "read_ms", "h2d_ms"):
        vals = sorted(getattr(r, phase) for r in ok)
        p99 = vals[min(len(vals) - 1, round(0.99 * (len(vals) - 1)))]
        print(f"{phase[:-3]:>5}: p50 {statistics.median(vals):.2f} ms  p99 {p99:.2f} ms",
              file=file)


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", default=f"127.0.0.1:{DEFAULT_PORT}", help="prefill HOST:PORT")
    p.add_argument("--requests", type=_positive(int, "--requests"), default=4)
    p.add_argument("--prompt-tokens", type=_positive(int, "--prompt-tokens"), nargs="+",
                   default=[512, 2048, 8192], help="cycled over the requests")
    p.add_argument("--read-timeout-s", type=_positive(float, "--read-timeout-s"), default=10.0)
    p.add_argument("--handshake-timeout-s", type=_positive(float, "--handshake-timeout-s"),
                   default=5.0)
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    add_layout_arguments(p)
    multihost.add_ucx_arguments(p)


def _failed_row(layout: str, rid: str, tokens: int, status: str, reason: str) -> Row:
    return Row(rid, layout, tokens, "-", 0, 0, 0.0, 0.0, 0.0, status, False, reason)


def _abort_in_flight(worker: DecodeWorker, addr: tuple[str, int], rid: str, why: str) -> str:
    """Abort ``rid`` here and at the prefill (which then frees its blocks, not at lease end)."""
    try:
        worker.abort(rid, reason=why)  # also asks the prefill to release
        return "READ aborted, prefill asked to release its blocks"
    except ValueError:  # not pending here: between steps; make sure prefill lets go
        try:
            worker.client(*addr).call(m.Release(request_id=rid), timeout_s=1.0)
            return "prefill released its blocks"
        except (HandshakeTimeout, PeerError, ValueError):
            return "prefill holds nothing for it (or frees it when its lease ends)"


def run_decode(args: argparse.Namespace) -> int:
    addr = parse_address(args.connect)
    layout = layout_from_args(args)
    rows: list[Row] = []
    try:
        multihost.probe(*addr, timeout_s=min(args.handshake_timeout_s, multihost.PROBE_TIMEOUT_S))
    except multihost.PeerUnavailable as exc:
        print(f"kvstage decode: {exc}", file=sys.stderr)
        return multihost.EXIT_UNUSABLE_PEER
    ucx = multihost.setup_ucx(args, addr[0])
    print(f"kvstage decode -> {args.connect} preset={layout.name} blocks={layout.num_blocks} "
          f"{ucx}", flush=True)
    rid, tokens = "", 0
    with multihost.signals_raise():
        try:
            worker = DecodeWorker(
                layout, device=args.device, host_layout=HostLayout(args.host_layout),
                transport=args.transport, read_timeout_s=args.read_timeout_s,
                handshake_timeout_s=args.handshake_timeout_s,
            )
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"kvstage decode: cannot start the decode worker ({ucx}): {exc}",
                  file=sys.stderr)
            return multihost.EXIT_UNUSABLE_PEER
        with worker:
            try:
                worker.connect(*addr)
            except (OSError, TimeoutError, ValueError, RuntimeError) as exc:
                print(f"kvstage decode: {multihost.explain(exc, args.connect)}", file=sys.stderr)
                return multihost.EXIT_UNUSABLE_PEER
            tag = f"{int(time.time() * 1000) % 10**8:08d}"
            try:
                for i in range(args.requests):
                    tokens = args.prompt_tokens[i % len(args.prompt_tokens)]
                    rid = f"d{tag}-{i}"
                    try:
                        row = run_one(worker, addr, rid, tokens, seed=i + 1,
                                      timeout_s=args.read_timeout_s)
                    except (HandshakeTimeout, PeerError, ValueError, OSError) as exc:
                        row = _failed_row(layout.name, rid, tokens, "failed", str(exc))
                    rows.append(row)
            except multihost.Interrupted as sig:
                how = _abort_in_flight(worker, addr, rid, f"interrupted by {sig.name}")
                rows.append(_failed_row(layout.name, rid, tokens, "aborted", sig.name))
                print_rows(rows)
                print(f"\nkvstage decode: {sig.name}: stopped after {len(rows) - 1}/"
                      f"{args.requests} requests; request {rid} aborted ({how})",
                      file=sys.stderr)
                return 128 + sig.signum
    print_rows(rows)
    print_summary(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"gbps": r.gbps} for r in rows], f, indent=2)
    return 0 if all(r.verified for r in rows) else 1
