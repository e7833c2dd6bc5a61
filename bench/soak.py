"""`python -m bench.soak`: many P/D requests with injected faults; every one accounted for.

One prefill + decode worker pair per model preset (created once, random block size,
cache layout and host layout per preset from ``--seed``), plus one *faulty* pair whose
decode side uses the loopback transport's fault options. Each request gets a random
prompt length; several stay in flight per pair and ready ones are finished out of
order, so both block pools churn and ids come out scattered. A ``--fault-rate``
fraction of requests get one injected fault:

- ``read_fail`` (faulty pair): the READ ends FAILED -> request failed, prefill frees
  its blocks when the lease ends;
- ``read_timeout`` (faulty pair): the READ stalls -> failed at the decode deadline;
- ``stalled_resumes`` (faulty pair): the READ stalls, fails at the decode deadline, and
  the stalled transfer resumes 0.2-1 s later while the pair serves other requests: its
  late bytes must land only in its own quarantined blocks (every later request stays
  byte-exact, and the quarantine gives the blocks back once the transfer ended);
- ``abort_stalled`` (faulty pair): the READ stalls and is aborted mid-flight ->
  aborted, prefill frees on the Release;
- ``notif_lost`` (faulty pair): bytes move but the notification is lost -> completed,
  prefill frees by lease;
- ``lease_expired`` (faulty pair): decode starts only after the prefill lease ended ->
  failed ("not held"), nothing read;
- ``abort`` (normal pair): aborted right after the READ was posted.

``--transport nixl``: each normal pair's prefill worker runs in its own spawned child
process (`PrefillProcess`) and decode READs it over real NIXL/UCX; the faulty pair is
loopback in this process (NIXL has no fault switches). ``--transport loopback``: every
prefill worker serves from a thread of this process.

At the end it checks, and exits 1 if any fails: every request has an outcome matching
its injected fault (completed ones verified byte-exact with ``verify_request``), every
decode pool is back to ``num_blocks - 1`` free, every prefill freed each request
exactly once (prefilled == completed + released + expired, nothing held), no transfer
handle is open or draining, and RSS grew less than ``--max-rss-growth-mib`` between
10 % and 100 % of the run (each read after a garbage collection and glibc's
``malloc_trim``: `workloads.settled_rss_bytes`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench import hostile
from bench.soak_report import (
    FAULT_KINDS,
    FAULTY_KINDS,
    build_report,
    categorize,
    print_report,
)
from bench.workloads import (
    STALLED,
    LayoutChoice,
    Pair,
    Record,
    max_tokens,
    random_choice,
    rss_bytes,
    settled_rss_bytes,
)
from kvstage.bench.report import machine_info, write_json
from kvstage.blocks import request_blocks
from kvstage.cli import memory, run_program
from kvstage.cli.args import add_json_argument, fraction, number, positive
from kvstage.errors import (
    PeerError,
    PoolExhausted,
    code_of,
)
from kvstage.pd import messages as m
from kvstage.pd.decode import RequestResult
from kvstage.presets import PRESETS
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillProcess, PrefillThread, make_decode, make_prefill
from kvstage.transport import TRANSPORTS

CHILD_START_S = 90.0


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # two streams: `plan` fixes layouts, faults, pairs and prompt lengths from the seed
        # alone; `rng` drives timing-dependent choices (finish order, abort delays)
        self.plan = random.Random(args.seed)
        self.rng = random.Random(args.seed + 1)
        self.pairs: list[Pair] = []
        self.records: list[Record] = []
        self.expiring: list[tuple[float, Pair, Record, m.PrefillDone]] = []
        # stalled transfers resume (late bytes land) at these times: a stalled prefill
        # that wakes up after decode gave up on it
        self.resumes: list[tuple[float, Pair]] = []
        self.backpressure = 0
        self.rss: dict[str, int] = {}
        self.child_rss: dict[str, dict[str, int]] = {}
        self.key = secrets.token_bytes(32)  # the pairs' side channels are authenticated
        self.hostiles = hostile.Hostiles(args.hostile_rate, args.seed + 2, self.key)

    # set-up ---------------------------------------------------------------------------
    def build(self) -> None:
        a = self.args
        pool = a.pool_mib << 20
        choices = [random_choice(name, self.plan, pool) for name in a.presets]
        lease, timeout = a.lease_s, a.lease_s / 2
        servers: list[PrefillThread | PrefillProcess] = []
        try:
            for choice in choices:
                if a.transport == "nixl":
                    servers.append(PrefillProcess(choice.layout(), lease_s=lease,
                                                  host_layout=choice.host_layout, key=self.key))
                else:
                    servers.append(self._thread(choice, lease))
            for choice, server in zip(choices, servers, strict=True):
                addr = server.wait_ready() if isinstance(server, PrefillProcess) else server.address
                self._add(choice.preset, choice, server, addr, lease, timeout, a.transport)
            # the faulty pair: short lease so lease-freed faults settle within the run
            faulty = random_choice(self.plan.choice(a.presets), self.plan, pool)
            server = self._thread(faulty, a.faulty_lease_s)
            self._add("faulty", faulty, server, server.address, a.faulty_lease_s,
                      a.faulty_lease_s / 4, "loopback", faulty=True)
        except BaseException:
            for s in servers:
                if not any(p.server is s for p in self.pairs):
                    s.stop()
            self.close()
            raise

    def _thread(self, choice: LayoutChoice, lease_s: float) -> PrefillThread:
        return PrefillThread(make_prefill(choice.layout(), lease_s=lease_s, key=self.key,
                                          transport="loopback", host_layout=choice.host_layout))

    def _add(self, name: str, choice: LayoutChoice, server: PrefillThread | PrefillProcess,
             addr: tuple[str, int], lease_s: float, read_timeout_s: float, transport: str,
             *, faulty: bool = False) -> None:
        try:
            decode = make_decode(choice.layout(), transport=transport,
                                 host_layout=choice.host_layout,
                                 read_timeout_s=read_timeout_s, handshake_timeout_s=10.0,
                                 key=self.key)
        except BaseException:
            server.stop()
            raise
        pair = Pair(name, choice, choice.layout(), decode, server, addr, lease_s, faulty)
        self.pairs.append(pair)
        decode.connect(*addr)
        self.hostiles.add(name, addr, transport)

    def close(self) -> None:
        self.hostiles.close()
        for p in self.pairs:
            with contextlib.suppress(Exception):
                p.decode.close()
            with contextlib.suppress(Exception):
                p.server.stop()

    # one request ------------------------------------------------------------------------
    def run(self) -> None:
        a = self.args
        normal = [p for p in self.pairs if not p.faulty]
        faulty = next(p for p in self.pairs if p.faulty)
        marks = {max(1, math.ceil(a.requests * f)): f"{round(f * 100)}%" for f in (0.1, 0.5)}
        deadline = time.monotonic() + a.timeout_s
        for i in range(a.requests):
            if time.monotonic() > deadline:
                break
            fault = "none"
            if self.plan.random() < a.fault_rate:
                fault = self.plan.choice(FAULT_KINDS)
            pair = faulty if fault in FAULTY_KINDS else self.plan.choice(normal)
            self._one(i, pair, fault)
            self.service()
            if i + 1 in marks:
                self._sample(marks[i + 1])
        self.drain(deadline)
        self._sample("100%")

    def _one(self, i: int, pair: Pair, fault: str) -> None:
        a = self.args
        budget = max(1, pair.layout.num_blocks // (a.max_in_flight + 2))
        tokens = self.plan.randint(1, max_tokens(pair.layout, budget))
        rec = Record(f"s{a.seed}-{i}", pair.name, fault, tokens, seed=i + 1)
        self.records.append(rec)
        need = sum(request_blocks(pair.layout, tokens))
        while pair.busy >= a.max_in_flight or pair.pool.num_free < need:
            self.service(finish_all=True)
        done = self._prefill(pair, rec)
        if done is None:
            return
        self.hostiles.maybe_attack(pair.name, rec.request_id)  # before decode starts it
        if fault == "lease_expired":
            # margin: prefill sweeps leases every few ms from its serving loop, and an
            # Acquire that arrives before the sweep still finds the blocks held
            self.expiring.append((time.monotonic() + pair.lease_s + 0.5, pair, rec, done))
            return
        self._start(pair, rec, done)
        if fault == "abort":
            self._abort(pair, rec.request_id, "soak: aborted right after the READ was posted")
        elif fault == "abort_stalled":
            # the READ is held stalled by the faulty transport; abort it a few ms in, with
            # no poll in between: scheduled for a later service() it lost the race to its
            # 0.25 s deadline once under load (ended read_timeout, RELIABILITY.md)
            time.sleep(self.rng.uniform(0, 0.02))
            self._abort(pair, rec.request_id, "soak: aborted a stalled READ mid-flight")

    def _prefill(self, pair: Pair, rec: Record) -> m.PrefillDone | None:
        msg = m.PrefillRequest(request_id=rec.request_id, num_tokens=rec.tokens, seed=rec.seed)
        for _ in range(4000):  # ~20 s of back-pressure at most
            try:
                done = pair.decode.client(*pair.address).call(msg)
            except PeerError as exc:
                if exc.remote_code != PoolExhausted.code:
                    self._end(rec, "failed", f"prefill refused: {exc}", code=exc.remote_code)
                    return None
                self.backpressure += 1  # prefill still holds blocks of earlier requests
                self.service(finish_all=True)
                time.sleep(0.005)
                continue
            except Exception as exc:
                self._end(rec, "failed", f"prefill call failed: {type(exc).__name__}: {exc}")
                return None
            assert isinstance(done, m.PrefillDone)
            return done
        self._end(rec, "failed", "prefill had no free blocks for 20 s")
        return None

    def _start(self, pair: Pair, rec: Record, done: m.PrefillDone) -> None:
        if pair.faulty:
            pair.set_faults(rec.fault)
        try:
            res = pair.decode.start(rec.request_id, pair.address, done.block_ids,
                                    capability=done.capability)
        except Exception as exc:
            self._end(rec, "failed", f"start raised {type(exc).__name__}: {exc}",
                      code=code_of(exc))
            return
        finally:
            if pair.faulty:
                pair.set_faults("none")
        pair.in_flight[rec.request_id] = (rec, res)
        if res.status != "pending":
            self._ended(pair, res)

    def _abort(self, pair: Pair, rid: str, reason: str) -> None:
        # in_flight holds exactly the requests decode still has pending: every result
        # poll() reports is consumed at once by service()
        entry = pair.in_flight.get(rid)
        if entry is not None and entry[1].status == "pending":
            self._ended(pair, pair.decode.abort(rid, reason=reason))

    # progress --------------------------------------------------------------------------
    def service(self, *, finish_all: bool = False) -> None:
        now = time.monotonic()
        for resume in list(self.resumes):
            pair = resume[1]
            # resuming lands every stalled transfer of the pair: wait until none of them
            # is still a pending request (it would complete, not fail as injected)
            if resume[0] <= now and not any(rec.fault in STALLED for rec, _ in
                                            pair.in_flight.values()):
                self.resumes.remove(resume)
                stalled: Any = pair.decode.transport
                stalled.resume_reads()
        for item in list(self.expiring):
            when, pair, rec, done = item
            if when <= now:
                self.expiring.remove(item)
                self._start(pair, rec, done)
        for pair in self.pairs:
            for res in pair.decode.poll():
                self._ended(pair, res)
            # finish ready requests in random order, some now, some later
            self.rng.shuffle(pair.ready)
            keep = []
            for rec, res in pair.ready:
                if finish_all or self.rng.random() < 0.5:
                    pair.decode.finish(res.request_id)
                else:
                    keep.append((rec, res))
            pair.ready = keep
        if finish_all:
            time.sleep(0.001)

    def _ended(self, pair: Pair, res: RequestResult) -> None:
        entry = pair.in_flight.pop(res.request_id, None)
        if entry is None:
            return
        rec = entry[0]
        if res.ok:
            problems = verify_request(pair.decode.cache, res.local_block_ids, rec.seed)
            self._end(rec, res.status, "; ".join(problems[:3]), verified=not problems)
            pair.ready.append((rec, res))
        else:
            self._end(rec, res.status, res.reason, code=res.code)
            if rec.fault in STALLED:
                late = (0.2, 1.0) if rec.fault == "stalled_resumes" else (0.0, 0.05)
                self.resumes.append((time.monotonic() + self.rng.uniform(*late), pair))

    def _end(self, rec: Record, status: str, reason: str, *, verified: bool = False,
             code: str = "") -> None:
        rec.outcome = categorize(status, code, verified)
        rec.reason = reason

    def drain(self, deadline: float) -> None:
        """Finish everything in flight (bounded), then wait for the prefill leases."""
        end = min(deadline, time.monotonic() + 4 * max(p.lease_s for p in self.pairs) + 5)
        while time.monotonic() < end and (
            self.expiring or self.resumes
            or any(p.in_flight or p.ready or p.decode.num_draining for p in self.pairs)
        ):
            self.service(finish_all=True)
        for pair in self.pairs:
            for rid in list(pair.in_flight):
                self._abort(pair, rid, "soak: drain deadline")
        lease_end = time.monotonic() + max(p.lease_s for p in self.pairs) + 3
        while time.monotonic() < lease_end:
            if all(p.stats().held_requests == 0 for p in self.pairs):
                break
            time.sleep(0.05)

    def _sample(self, mark: str) -> None:
        self.rss[mark] = settled_rss_bytes()  # held, not freed pages kept by malloc
        for p in self.pairs:
            if isinstance(p.server, PrefillProcess):
                self.child_rss.setdefault(p.name, {})[mark] = rss_bytes(p.server.pid)



def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--requests", type=positive(int, "--requests", high=10**7), default=1000,
      help="requests to run (default 1000)")
    a("--seed", type=int, default=0, help="layouts, prompt lengths, faults, order")
    a("--fault-rate", type=fraction("--fault-rate"), default=0.05,
      help="fraction of requests with one injected fault (default 0.05)")
    a("--transport", choices=sorted(TRANSPORTS), default="nixl",
      help="nixl: prefill in one child process per preset, real NIXL READs (default)")
    a("--presets", nargs="+", choices=sorted(PRESETS), default=sorted(PRESETS))
    a("--max-in-flight", type=positive(int, "--max-in-flight", high=1024), default=4,
      help="requests in flight or ready per pair (default 4)")
    a("--pool-mib", type=positive(int, "--pool-mib", high=4096), default=16,
      help="target pool size per side")
    a("--lease-s", type=positive(float, "--lease-s", high=3600.0), default=10.0,
      help="prefill lease of the normal pairs (decode READ timeout: half of it)")
    a("--faulty-lease-s", type=positive(float, "--faulty-lease-s", high=3600.0), default=1.0,
      help="prefill lease of the faulty pair (its READ timeout: a quarter of it)")
    a("--max-rss-growth-mib", type=number(int, "--max-rss-growth-mib", inclusive=True),
      default=64)
    a("--timeout-s", type=positive(float, "--timeout-s", high=86400.0), default=1800.0,
      help="bound on the whole run")
    hostile.add_arguments(parser)
    add_json_argument(parser, "the summary and every request")


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Build the pairs, run the requests, drain, and return the report (``broken`` lists
    every invariant that failed; empty means all hold). Always tears everything down."""
    soak = Soak(args)
    start = time.monotonic()
    try:
        soak.build()
        soak.run()
        rep = build_report(soak)
    finally:
        soak.close()
    rep["wall_s"] = time.monotonic() - start
    return rep


def run(args: argparse.Namespace) -> int:
    if args.transport == "nixl":
        import importlib.util

        if not any(importlib.util.find_spec(n) for n in ("nixl_cu12", "nixl")):
            print("python -m bench.soak: --transport nixl needs NIXL: pip install "
                  "'kvstage[nixl]' (or use --transport loopback)", file=sys.stderr)
            return 2
    pairs = len(args.presets) + 1  # one per preset and the faulty pair
    memory.check_fits(  # a refusal is one line, exit 2 (kvstage.cli.main)
        f"--pool-mib {args.pool_mib} ({pairs} pairs of prefill and decode, each side a "
        f"device pool and a host buffer)", 4 * pairs * (args.pool_mib << 20),
        "lower --pool-mib or pass fewer --presets")
    rep = execute(args)
    wall = rep.pop("wall_s")
    print_report(rep, args, wall)
    if args.json:
        write_json(args.json, config=vars(args), env=machine_info(), wall_s=wall, **rep)
    return 1 if rep["broken"] else 0




def main(argv: Sequence[str] | None = None) -> int:
    """`python -m bench.soak ARGS`: one-line errors and exit 2 for bad input, as `kvstage`."""
    return run_program(sys.modules[__name__], "python -m bench.soak", argv)


if __name__ == "__main__":
    sys.exit(main())
