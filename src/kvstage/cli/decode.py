"""`kvstage decode --connect HOST:PORT`: run prompts against a prefill and verify bytes.

Asks the prefill side to run prompts (standing in for the proxy that routes a request
to prefill first), READs each one, loads it to its device, verifies every byte, and
prints one row per request plus a summary (GB/s, p50/p99 latency per phase). A prefill
that stops answering ends the run at the first refused or unanswered request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import TextIO

from kvstage.cli import args as cli_args
from kvstage.cli import net
from kvstage.errors import HandshakeTimeout, KVStageError, PeerError, PeerUnavailable
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.side_channel import parse_address
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import make_decode

DEFAULT_PORT = 5600
PREFILL_TIMEOUT_S = 60.0  # a PrefillRequest's answer (the prompt's "forward pass")
#: the largest prompt a CLI decode asks for (gemma-3-1b: 8 GiB of KV at 2**24 tokens)
MAX_PROMPT_TOKENS = 1 << 24


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
            timeout_s: float, issued: dict[str, bytes] | None = None) -> Row:
    client = worker.client(*addr)
    # the prefill computes the prompt before it answers: not a handshake, so not bounded
    # by the handshake timeout (128 MiB of llama-3.1-8b KV takes seconds on a busy host)
    done = client.call(m.PrefillRequest(request_id=rid, num_tokens=tokens, seed=seed),
                       timeout_s=max(PREFILL_TIMEOUT_S, worker.handshake_timeout_s))
    assert isinstance(done, m.PrefillDone)
    if issued is not None:  # the capability, so an interrupt can still release it
        issued.clear()
        issued[rid] = done.capability
    res = worker.start(rid, addr, done.block_ids, capability=done.capability)
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
              f"{f'{r.gbps:.2f}' if r.verified else '-':>10}  {verdict}", file=file)


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", default=f"127.0.0.1:{DEFAULT_PORT}",
                   type=cli_args.address("--connect", listen=False), help="prefill HOST:PORT")
    p.add_argument("--requests", type=cli_args.positive(int, "--requests", high=10**6),
                   default=4)
    p.add_argument("--prompt-tokens", nargs="+", default=[512, 2048, 8192],
                   type=cli_args.positive(int, "--prompt-tokens", high=MAX_PROMPT_TOKENS),
                   help="cycled over the requests")
    p.add_argument("--read-timeout-s", default=10.0,
                   type=cli_args.positive(float, "--read-timeout-s", high=3600.0))
    p.add_argument("--handshake-timeout-s", default=5.0,
                   type=cli_args.positive(float, "--handshake-timeout-s", high=3600.0))
    cli_args.add_json_argument(p)
    cli_args.add_layout_arguments(p)
    cli_args.add_ucx_arguments(p)
    cli_args.add_auth_arguments(p)
    cli_args.add_integrity_argument(p)
    p.add_argument("--pipeline", action=argparse.BooleanOptionalAction, default=None,
                   help="READ each request in chunks and load chunk k to the device while "
                        "k+1 is in flight (kvstage.pd.pipeline; BENCHMARKS.md 'Does "
                        "pipelining hide the copies?'). Default: on for a prefill off "
                        "loopback, where every chunk in flight fills a TCP link that one "
                        "READ does not (BENCHMARKS.md 'How fast is the READ across hosts "
                        "over TCP?'), off on loopback")


def pipelined(asked: bool | None, host: str) -> bool:
    """``--pipeline`` / ``--no-pipeline`` as given, else on for a prefill off loopback."""
    from kvstage.pd.auth import is_loopback

    return asked if asked is not None else not is_loopback(host)


def _failed_row(layout: str, rid: str, tokens: int, status: str, reason: str) -> Row:
    return Row(rid, layout, tokens, "-", 0, 0, 0.0, 0.0, 0.0, status, False, reason)


def _abort_in_flight(worker: DecodeWorker, addr: tuple[str, int], rid: str, why: str,
                     capability: bytes) -> str:
    """Abort ``rid`` here and at the prefill (which then frees its blocks, not at lease end)."""
    try:
        worker.abort(rid, reason=why)  # also asks the prefill to release
        return "READ aborted, prefill asked to release its blocks"
    except ValueError:  # not pending here: between steps; make sure prefill lets go
        try:
            worker.client(*addr).call(m.Release(request_id=rid, capability=capability),
                                      timeout_s=1.0)
            return "prefill released its blocks"
        except KVStageError:
            return "prefill holds nothing for it (or frees it when its lease ends)"


def run(args: argparse.Namespace) -> int:
    try:
        addr = parse_address(args.connect)
        layout = cli_args.layout_from_args(args)
        key = cli_args.key_from_args(args, addr[0], "decode")
    except (KVStageError, argparse.ArgumentTypeError) as exc:
        print(f"kvstage decode: {exc}", file=sys.stderr)
        return 2
    rows: list[Row] = []
    try:
        net.probe(*addr, timeout_s=min(args.handshake_timeout_s, net.PROBE_TIMEOUT_S))
    except PeerUnavailable as exc:
        print(f"kvstage decode: {exc}", file=sys.stderr)
        return net.EXIT_UNUSABLE_PEER
    ucx = cli_args.setup_ucx(args, addr[0])
    print(f"kvstage decode -> {args.connect} preset={layout.name} blocks={layout.num_blocks} "
          f"{ucx}", flush=True)
    rid, tokens = "", 0
    issued: dict[str, bytes] = {}  # request id -> capability (for an interrupt's Release)
    with net.signals_raise():
        try:
            worker = make_decode(
                layout, device=args.device, host_layout=args.host_layout,
                transport=args.transport, read_timeout_s=args.read_timeout_s,
                handshake_timeout_s=args.handshake_timeout_s, key=key,
                verify_checksum=args.verify_checksum, pipeline=pipelined(args.pipeline, addr[0]),
            )
        except (OSError, RuntimeError, ValueError, ImportError) as exc:
            print(f"kvstage decode: cannot start the decode worker ({ucx}): {exc}",
                  file=sys.stderr)
            return net.EXIT_UNUSABLE_PEER
        with worker:
            try:
                worker.connect(*addr)
            except (OSError, TimeoutError, ValueError, RuntimeError) as exc:
                print(f"kvstage decode: {net.explain(exc, args.connect)}", file=sys.stderr)
                return net.EXIT_UNUSABLE_PEER
            tag = f"{int(time.time() * 1000) % 10**8:08d}"
            try:
                for i in range(args.requests):
                    tokens = args.prompt_tokens[i % len(args.prompt_tokens)]
                    rid = f"d{tag}-{i}"
                    try:
                        row = run_one(worker, addr, rid, tokens, seed=i + 1,
                                      timeout_s=args.read_timeout_s, issued=issued)
                    except (HandshakeTimeout, PeerUnavailable) as exc:
                        # the prefill stopped answering: every later request would wait
                        # out its own timeout, so stop here
                        rows.append(_failed_row(layout.name, rid, tokens, "failed", str(exc)))
                        print(f"kvstage decode: prefill at {args.connect} stopped answering; "
                              f"{args.requests - i - 1} requests not sent", file=sys.stderr)
                        break
                    except (PeerError, ValueError, OSError) as exc:
                        row = _failed_row(layout.name, rid, tokens, "failed", str(exc))
                    rows.append(row)
            except net.Interrupted as sig:
                how = _abort_in_flight(worker, addr, rid, f"interrupted by {sig.name}",
                                       issued.get(rid, b""))
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
