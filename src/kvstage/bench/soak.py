"""`kvstage bench soak`: many P/D requests with injected faults; every one accounted for.

One prefill + decode worker pair per model preset (created once, random block size,
cache layout and host layout per preset from ``--seed``), plus one *faulty* pair whose
decode side uses the loopback transport's fault options. Each request gets a random
prompt length; several stay in flight per pair and ready ones are finished out of
order, so both block pools churn and ids come out scattered. A ``--fault-rate``
fraction of requests get one injected fault:

- ``read_fail`` (faulty pair): the READ ends FAILED -> request failed, prefill frees
  its blocks when the lease ends;
- ``read_timeout`` (faulty pair): the READ stalls -> failed at the decode deadline;
- ``abort_stalled`` (faulty pair): the READ stalls and is aborted mid-flight ->
  aborted, prefill frees on the Release;
- ``notif_lost`` (faulty pair): bytes move but the notification is lost -> completed,
  prefill frees by lease;
- ``lease_expired`` (faulty pair): decode starts only after the prefill lease ended ->
  failed ("not held"), nothing read;
- ``abort`` (normal pair): aborted right after the READ was posted.

``--transport nixl``: each normal pair's prefill worker runs in its own spawned child
process (`PrefillChild`) and decode READs it over real NIXL/UCX; the faulty pair is
loopback in this process (NIXL has no fault switches). ``--transport loopback``: every
prefill worker serves from a thread of this process.

At the end it checks, and exits 1 if any fails: every request has an outcome matching
its injected fault (completed ones verified byte-exact with ``verify_request``), every
decode pool is back to ``num_blocks - 1`` free, every prefill freed each request
exactly once (prefilled == completed + released + expired, nothing held), no transfer
handle is open or draining, and RSS grew less than ``--max-rss-growth-mib`` between
10 % and 100 % of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from kvstage.bench.report import machine_info, write_json
from kvstage.blocks import request_blocks
from kvstage.cache import HostLayout
from kvstage.layout import CacheLayout, KVLayout, MLASpec
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker, RequestResult
from kvstage.pd.handshake import PeerError
from kvstage.pd.prefill import PrefillWorker
from kvstage.presets import PRESETS, preset
from kvstage.testing.pattern import verify_request

FAULTY_KINDS = ("read_fail", "read_timeout", "abort_stalled", "notif_lost", "lease_expired")
FAULT_KINDS = (*FAULTY_KINDS, "abort")
# what each injected fault must end as (the outcome categories of `categorize`)
EXPECTED = {
    "none": "completed",
    "read_fail": "read_failed",
    "read_timeout": "read_timeout",
    "abort_stalled": "aborted",
    "notif_lost": "completed",
    "lease_expired": "lease_expired",
    "abort": "aborted",
}
MIN_BLOCKS = 48
CHILD_START_S = 90.0


# -- layouts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutChoice:
    """A preset with the knobs a soak randomises; picklable for a spawned child."""

    preset: str
    num_blocks: int
    block_size: int = 16
    cache_layout: str = CacheLayout.PACKED.value
    host_layout: str = HostLayout.BLOCK_MAJOR.value

    def layout(self) -> KVLayout:
        return preset(self.preset, num_blocks=self.num_blocks, block_size=self.block_size,
                      cache_layout=CacheLayout(self.cache_layout))

    def describe(self) -> str:
        return (f"{self.preset} (block_size {self.block_size}, {self.cache_layout}, "
                f"host {self.host_layout}, {self.num_blocks} blocks)")


def random_choice(name: str, rng: random.Random, pool_bytes: int) -> LayoutChoice:
    """Block size, cache and host layout at random; ``num_blocks`` so the pool is about
    ``pool_bytes`` (at least `MIN_BLOCKS`; block sizes whose pool would exceed twice the
    target at that minimum are skipped: llama-3.1-8b at block_size 16 is 2 MiB a block)."""
    is_mla = isinstance(preset(name, num_blocks=2).spec, MLASpec)
    sizes = [bs for bs in (4, 8, 16)
             if preset(name, num_blocks=2, block_size=bs).block_bytes * MIN_BLOCKS
             <= 2 * pool_bytes] or [4]
    bs = rng.choice(sizes)
    cache = CacheLayout.PACKED if is_mla else rng.choice(list(CacheLayout))
    host = rng.choice(list(HostLayout))
    block_bytes = preset(name, num_blocks=2, block_size=bs).block_bytes
    blocks = max(MIN_BLOCKS, pool_bytes // block_bytes)
    return LayoutChoice(name, blocks, bs, cache.value, host.value)


def max_tokens(layout: KVLayout, budget_blocks: int) -> int:
    """Largest prompt whose blocks (all groups, sliding windows clipped) fit the budget."""
    lo, hi = 1, 1 << 20
    if sum(request_blocks(layout, 1)) > budget_blocks:
        return 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(request_blocks(layout, mid)) <= budget_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


# -- prefill servers ----------------------------------------------------------------------
def _prefill_child(conn: Connection, choice: LayoutChoice, lease_s: float, port: int,
                   parent_pid: int) -> None:
    """Spawned child: a NIXL PrefillWorker served until "stop" or the parent dies."""
    try:
        worker = PrefillWorker(choice.layout(), port=port, lease_s=lease_s, transport="nixl",
                               host_layout=HostLayout(choice.host_layout))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        conn.send(("ready", worker.address))
        while os.getppid() == parent_pid:
            worker.serve_once(0.005)
            if conn.poll() and conn.recv() == "stop":
                break
    finally:
        worker.close()


class PrefillChild:
    """A NIXL `PrefillWorker` in a spawned child process on 127.0.0.1.

    ``start`` returns at once; ``wait_ready`` blocks (bounded) for the bound address, so
    several children start in parallel. The child exits on `stop`, or by itself when
    this process dies (it watches its parent), so a crashed soak leaves no orphans.
    """

    def __init__(self, choice: LayoutChoice, *, lease_s: float, port: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.choice = choice
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_prefill_child, daemon=True,
                                args=(child, choice, lease_s, port, os.getpid()))
        self.proc.start()
        child.close()
        self.address: tuple[str, int] | None = None

    def wait_ready(self, timeout_s: float = CHILD_START_S) -> tuple[str, int]:
        if self.address is not None:
            return self.address
        if not self._conn.poll(timeout_s):
            self.kill()
            raise TimeoutError(f"prefill child not ready within {timeout_s} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(
                f"prefill child exited with {self.proc.exitcode} before it was ready"
            ) from None
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"prefill child failed to start: {value}")
        self.address = (str(value[0]), int(value[1]))
        return self.address

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: the process dies without closing anything (a crash)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send("stop")
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.kill()
        self._conn.close()


class PrefillThread:
    """An in-process `PrefillWorker` served from a daemon thread (loopback transport)."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.address = worker.address
        self._thread = threading.Thread(target=worker.serve_forever, kwargs={"poll_s": 0.005},
                                        daemon=True, name=f"serve-{worker.engine_id}")
        self._thread.start()

    def stop(self) -> None:
        self.worker.stop()
        self._thread.join(10)
        self.worker.close()


# -- bookkeeping ----------------------------------------------------------------------------
@dataclass
class Record:
    request_id: str
    pair: str
    fault: str
    tokens: int
    seed: int
    outcome: str = "unfinished"
    reason: str = ""


@dataclass
class Pair:
    name: str
    choice: LayoutChoice
    layout: KVLayout
    decode: DecodeWorker
    server: PrefillThread | PrefillChild
    address: tuple[str, int]
    lease_s: float
    faulty: bool = False
    in_flight: dict[str, tuple[Record, RequestResult]] = field(default_factory=dict)
    ready: list[tuple[Record, RequestResult]] = field(default_factory=list)

    @property
    def busy(self) -> int:
        return len(self.in_flight) + len(self.ready)

    def stats(self) -> m.Stats:
        reply = self.decode.client(*self.address).call(m.GetStats(), timeout_s=5.0)
        assert isinstance(reply, m.Stats)
        return reply

    def set_faults(self, kind: str) -> None:
        t: Any = self.decode.transport
        t.fail_reads = kind == "read_fail"
        t.stall_reads = kind in ("read_timeout", "abort_stalled")
        t.drop_notifs = kind == "notif_lost"


def categorize(status: str, reason: str, verified: bool) -> str:
    if status == "done":
        return "completed" if verified else "corrupt"
    if status == "aborted":
        return "aborted"
    if "timed out" in reason:
        return "read_timeout"
    if "READ failed" in reason:
        return "read_failed"
    if "not held" in reason:
        return "lease_expired"
    if "HandshakeTimeout" in reason:
        return "handshake_timeout"
    if "TransportError" in reason:
        return "transport_error"
    return "other_failure"


def rss_bytes(pid: int | str = "self") -> int:
    """VmRSS from /proc/PID/status (0 where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- the run ----------------------------------------------------------------------------------
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
        self.aborts: list[tuple[float, Pair, str]] = []
        self.backpressure = 0
        self.rss: dict[str, int] = {}
        self.child_rss: dict[str, dict[str, int]] = {}

    # set-up ---------------------------------------------------------------------------
    def build(self) -> None:
        a = self.args
        pool = a.pool_mib << 20
        choices = [random_choice(name, self.plan, pool) for name in a.presets]
        lease, timeout = a.lease_s, a.lease_s / 2
        servers: list[PrefillThread | PrefillChild] = []
        try:
            for choice in choices:
                if a.transport == "nixl":
                    servers.append(PrefillChild(choice, lease_s=lease))
                else:
                    servers.append(self._thread(choice, lease))
            for choice, server in zip(choices, servers, strict=True):
                addr = server.wait_ready() if isinstance(server, PrefillChild) else server.address
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
        worker = PrefillWorker(choice.layout(), lease_s=lease_s, transport="loopback",
                               host_layout=HostLayout(choice.host_layout))
        return PrefillThread(worker)

    def _add(self, name: str, choice: LayoutChoice, server: PrefillThread | PrefillChild,
             addr: tuple[str, int], lease_s: float, read_timeout_s: float, transport: str,
             *, faulty: bool = False) -> None:
        try:
            decode = DecodeWorker(choice.layout(), transport=transport,
                                  host_layout=HostLayout(choice.host_layout),
                                  read_timeout_s=read_timeout_s, handshake_timeout_s=10.0)
        except BaseException:
            server.stop()
            raise
        pair = Pair(name, choice, choice.layout(), decode, server, addr, lease_s, faulty)
        self.pairs.append(pair)
        decode.connect(*addr)

    def close(self) -> None:
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
        while pair.busy >= a.max_in_flight or pair.decode.pool.num_free < need:
            self.service(finish_all=True)
        done = self._prefill(pair, rec)
        if done is None:
            return
        if fault == "lease_expired":
            # margin: prefill sweeps leases every few ms from its serving loop, and an
            # Acquire that arrives before the sweep still finds the blocks held
            self.expiring.append((time.monotonic() + pair.lease_s + 0.5, pair, rec, done))
            return
        self._start(pair, rec, done)
        if fault == "abort":
            self._abort(pair, rec.request_id, "soak: aborted right after the READ was posted")
        elif fault == "abort_stalled":
            self.aborts.append((time.monotonic() + self.rng.uniform(0, 0.05), pair,
                                rec.request_id))

    def _prefill(self, pair: Pair, rec: Record) -> m.PrefillDone | None:
        msg = m.PrefillRequest(request_id=rec.request_id, num_tokens=rec.tokens, seed=rec.seed)
        for _ in range(4000):  # ~20 s of back-pressure at most
            try:
                done = pair.decode.client(*pair.address).call(msg)
            except PeerError as exc:
                if "are free" not in str(exc):
                    self._end(rec, "failed", f"prefill refused: {exc}")
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
            res = pair.decode.start(rec.request_id, pair.address, done.block_ids)
        except Exception as exc:
            self._end(rec, "failed", f"start raised {type(exc).__name__}: {exc}")
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
        for when, pair, rid in list(self.aborts):
            if when <= now:
                self.aborts.remove((when, pair, rid))
                self._abort(pair, rid, "soak: aborted a stalled READ mid-flight")
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
            self._end(rec, res.status, res.reason)

    def _end(self, rec: Record, status: str, reason: str, *, verified: bool = False) -> None:
        rec.outcome = categorize(status, reason, verified)
        rec.reason = reason

    def drain(self, deadline: float) -> None:
        """Finish everything in flight (bounded), then wait for the prefill leases."""
        end = min(deadline, time.monotonic() + 4 * max(p.lease_s for p in self.pairs) + 5)
        while time.monotonic() < end and (
            self.expiring or self.aborts or any(p.in_flight or p.ready for p in self.pairs)
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
        self.rss[mark] = rss_bytes()
        for p in self.pairs:
            if isinstance(p.server, PrefillChild):
                self.child_rss.setdefault(p.name, {})[mark] = rss_bytes(p.server.pid)

    # verdict ------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        a = self.args
        outcomes = Counter(r.outcome for r in self.records)
        reasons = Counter(f"{r.outcome}: {_reason_key(r.reason)}" for r in self.records
                          if r.outcome != "completed")
        by_fault: dict[str, Counter[str]] = {}
        for r in self.records:
            by_fault.setdefault(r.fault, Counter())[r.outcome] += 1
        mismatched = [r for r in self.records if r.outcome != EXPECTED[r.fault]]
        pairs = []
        broken: list[str] = []
        for p in self.pairs:
            s = p.stats()
            d = p.decode
            row = {
                "pair": p.name, "layout": p.choice.describe(),
                "transport": "loopback" if isinstance(p.server, PrefillThread) else "nixl",
                "decode_free": d.pool.num_free, "decode_total": p.layout.num_blocks - 1,
                "decode_open_handles": d.transport.num_open_handles,
                "decode_draining": d.num_draining, "decode_pending": d.num_pending,
                "prefill_free": s.free_blocks, "prefill_held_requests": s.held_requests,
                "prefill_open_handles": s.open_handles, "prefilled": s.prefilled,
                "completed": s.completed, "released": s.released, "expired": s.expired,
                "unknown_notifs": len(s.unknown_notifs),
            }
            pairs.append(row)
            if d.pool.num_free != p.layout.num_blocks - 1:
                broken.append(f"{p.name}: decode pool has {d.pool.num_free} of "
                              f"{p.layout.num_blocks - 1} blocks free (leak)")
            if s.free_blocks != p.layout.num_blocks - 1 or s.held_requests:
                broken.append(f"{p.name}: prefill holds {s.held_requests} requests, "
                              f"{s.free_blocks} of {p.layout.num_blocks - 1} blocks free (leak)")
            if s.prefilled != s.completed + s.released + s.expired:
                broken.append(f"{p.name}: prefill freed {s.completed + s.released + s.expired}"
                              f" requests of {s.prefilled} prefilled")
            if d.transport.num_open_handles or d.num_draining or d.num_pending or s.open_handles:
                broken.append(f"{p.name}: open transfer handles (decode "
                              f"{d.transport.num_open_handles}, draining {d.num_draining}, "
                              f"pending {d.num_pending}, prefill {s.open_handles})")
        if len(self.records) != a.requests:
            broken.append(f"only {len(self.records)} of {a.requests} requests ran "
                          f"(--timeout-s {a.timeout_s} reached)")
        if outcomes.get("corrupt"):
            broken.append(f"{outcomes['corrupt']} completed requests had wrong bytes")
        if mismatched:
            shown = "; ".join(f"{r.request_id} ({r.fault}) -> {r.outcome}: {r.reason[:120]}"
                              for r in mismatched[:5])
            broken.append(f"{len(mismatched)} requests ended unlike their fault: {shown}")
        growth = self.rss.get("100%", 0) - self.rss.get("10%", 0)
        if growth > a.max_rss_growth_mib << 20:
            broken.append(f"RSS grew {growth / 2**20:.1f} MiB between 10% and 100% "
                          f"(limit {a.max_rss_growth_mib} MiB)")
        return {
            "requests": len(self.records),
            "outcomes": dict(sorted(outcomes.items())),
            "reasons": dict(sorted(reasons.items())),
            "by_fault": {k: dict(v) for k, v in sorted(by_fault.items())},
            "pairs": pairs,
            "backpressure_retries": self.backpressure,
            "rss_bytes": self.rss,
            "rss_growth_bytes": growth,
            "child_rss_bytes": self.child_rss,
            "broken": broken,
            "records": [asdict(r) for r in self.records] if a.json else [],
        }


def _reason_key(reason: str) -> str:
    """A reason without request-specific numbers, for counting."""
    head = reason.split(":")[0] if reason.startswith(("PeerError", "TransportError")) else reason
    return "".join("N" if c.isdigit() else c for c in head)[:90]


def print_report(rep: dict[str, Any], args: argparse.Namespace, wall_s: float) -> None:
    print(f"kvstage bench soak: {rep['requests']} requests in {wall_s:.1f} s, seed {args.seed}, "
          f"fault rate {args.fault_rate}, transport {args.transport}")
    print("\npairs (prefill -> decode):")
    for p in rep["pairs"]:
        print(f"  {p['pair']:<18} {p['transport']:<9} {p['layout']}")
    print("\noutcomes:")
    for k, v in rep["outcomes"].items():
        print(f"  {k:<18} {v:>6}")
    if rep["reasons"]:
        print("reasons (not completed):")
        for k, v in rep["reasons"].items():
            print(f"  {v:>6}  {k}")
    print("by injected fault (expected outcome):")
    for fault, counts in rep["by_fault"].items():
        got = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        print(f"  {fault:<14} -> {EXPECTED[fault]:<14} got {got}")
    print("\nleaks and handles after the run:")
    for p in rep["pairs"]:
        print(f"  {p['pair']:<18} decode free {p['decode_free']}/{p['decode_total']} "
              f"handles {p['decode_open_handles']} draining {p['decode_draining']} | prefill "
              f"free {p['prefill_free']}/{p['decode_total']} held {p['prefill_held_requests']} "
              f"handles {p['prefill_open_handles']} | prefilled {p['prefilled']} = completed "
              f"{p['completed']} + released {p['released']} + expired {p['expired']} "
              f"(late notifs {p['unknown_notifs']})")
    rss = rep["rss_bytes"]
    print("\nRSS of this process: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in rss.items())
          + f"; growth 10%->100% {rep['rss_growth_bytes'] / 2**20:+.1f} MiB")
    for name, marks in rep["child_rss_bytes"].items():
        vals = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in marks.items())
        print(f"  prefill child {name}: {vals} MiB")
    print(f"prefill back-pressure retries: {rep['backpressure_retries']}")
    if rep["broken"]:
        print("\nINVARIANTS BROKEN:")
        for b in rep["broken"]:
            print(f"  - {b}")
    else:
        print("\nall invariants hold: every request accounted for, no leaked blocks, "
              "no open handles, RSS flat")


# -- CLI ----------------------------------------------------------------------------------------
def _int_at_least(low: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--requests", type=_int_at_least(1), default=1000, help="requests to run (default 1000)")
    a("--seed", type=int, default=0, help="layouts, prompt lengths, faults, order")
    a("--fault-rate", type=_fraction, default=0.05,
      help="fraction of requests with one injected fault (default 0.05)")
    a("--transport", choices=("loopback", "nixl"), default="nixl",
      help="nixl: prefill in one child process per preset, real NIXL READs (default)")
    a("--presets", nargs="+", choices=sorted(PRESETS), default=sorted(PRESETS))
    a("--max-in-flight", type=_int_at_least(1), default=4,
      help="requests in flight or ready per pair (default 4)")
    a("--pool-mib", type=_int_at_least(1), default=16, help="target pool size per side")
    a("--lease-s", type=_positive_float, default=10.0,
      help="prefill lease of the normal pairs (decode READ timeout: half of it)")
    a("--faulty-lease-s", type=_positive_float, default=1.0,
      help="prefill lease of the faulty pair (its READ timeout: a quarter of it)")
    a("--max-rss-growth-mib", type=_int_at_least(0), default=64)
    a("--timeout-s", type=_positive_float, default=1800.0, help="bound on the whole run")
    a("--json", default=None, metavar="PATH", help="write the summary and every request")


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Build the pairs, run the requests, drain, and return the report (``broken`` lists
    every invariant that failed; empty means all hold). Always tears everything down."""
    soak = Soak(args)
    start = time.monotonic()
    try:
        soak.build()
        soak.run()
        rep = soak.report()
    finally:
        soak.close()
    rep["wall_s"] = time.monotonic() - start
    return rep


def run_soak(args: argparse.Namespace) -> int:
    if args.transport == "nixl":
        import importlib.util

        if not any(importlib.util.find_spec(n) for n in ("nixl_cu12", "nixl")):
            print("kvstage bench soak: --transport nixl needs NIXL: pip install "
                  "'kvstage[nixl]' (or use --transport loopback)", file=sys.stderr)
            return 2
    rep = execute(args)
    wall = rep.pop("wall_s")
    print_report(rep, args, wall)
    if args.json:
        write_json(args.json, config=vars(args), env=machine_info(), wall_s=wall, **rep)
    return 1 if rep["broken"] else 0


add_arguments = add_soak_arguments
run = run_soak
