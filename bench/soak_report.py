"""`python -m bench.soak`'s printed report."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import asdict
from typing import Any

from kvstage.errors import HandshakeTimeout, NotHeld, TransportFailure
from kvstage.pd import decode
from kvstage.testing.servers import PrefillThread

FAULTY_KINDS = ("read_fail", "read_timeout", "abort_stalled", "notif_lost", "lease_expired",
                "stalled_resumes")
FAULT_KINDS = (*FAULTY_KINDS, "abort")
# what each injected fault must end as (the outcome categories of `categorize`)
EXPECTED = {
    "none": "completed",
    "read_fail": "read_failed",
    "read_timeout": "read_timeout",
    "abort_stalled": "aborted",
    "stalled_resumes": "read_timeout",
    "notif_lost": "completed",
    "lease_expired": "lease_expired",
    "abort": "aborted",
}

_OUTCOMES = {
    decode.ABORTED: "aborted",
    decode.READ_TIMEOUT: "read_timeout",
    decode.READ_FAILED: "read_failed",
    NotHeld.code: "lease_expired",
    HandshakeTimeout.code: "handshake_timeout",
    TransportFailure.code: "transport_error",
}


def categorize(status: str, code: str, verified: bool) -> str:
    """A request's outcome from its status and error code (never from message text)."""
    if status == "done":
        return "completed" if verified else "corrupt"
    if status == "aborted":
        return "aborted"
    return _OUTCOMES.get(code, "other_failure")


def build_report(soak: Any) -> dict[str, Any]:
    """The soak's verdict: outcomes, per-pair accounting, RSS, and every broken invariant."""
    a = soak.args
    outcomes = Counter(r.outcome for r in soak.records)
    reasons = Counter(f"{r.outcome}: {_reason_key(r.reason)}" for r in soak.records
                      if r.outcome != "completed")
    by_fault: dict[str, Counter[str]] = {}
    for r in soak.records:
        by_fault.setdefault(r.fault, Counter())[r.outcome] += 1
    mismatched = [r for r in soak.records if r.outcome != EXPECTED[r.fault]]
    pairs = []
    broken: list[str] = []
    for p in soak.pairs:
        s = p.stats()
        d = p.decode
        row = {
            "pair": p.name, "layout": p.choice.describe(),
            "transport": "loopback" if isinstance(p.server, PrefillThread) else "nixl",
            "decode_free": p.pool.num_free, "decode_total": p.layout.num_blocks - 1,
            "decode_open_handles": d.transport.num_open_handles,
            "decode_draining": d.num_draining, "decode_pending": d.num_pending,
            "prefill_free": s.free_blocks, "prefill_held_requests": s.held_requests,
            "prefill_open_handles": s.open_handles, "prefilled": s.prefilled,
            "completed": s.completed, "released": s.released, "expired": s.expired,
            "unknown_notifs": s.num_unknown_notifs,
            "unauthorized": s.unauthorized, "bad_capability": s.bad_capability,
        }
        pairs.append(row)
        if p.pool.num_free != p.layout.num_blocks - 1:
            broken.append(f"{p.name}: decode pool has {p.pool.num_free} of "
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
    if len(soak.records) != a.requests:
        broken.append(f"only {len(soak.records)} of {a.requests} requests ran "
                      f"(--timeout-s {a.timeout_s} reached)")
    if outcomes.get("corrupt"):
        broken.append(f"{outcomes['corrupt']} completed requests had wrong bytes")
    if mismatched:
        shown = "; ".join(f"{r.request_id} ({r.fault}) -> {r.outcome}: {r.reason[:120]}"
                          for r in mismatched[:5])
        broken.append(f"{len(mismatched)} requests ended unlike their fault: {shown}")
    hostile = soak.hostiles.report()
    if hostile["forged_accepted"]:
        broken.append(f"forged state changes accepted: {hostile['forged_accepted']} "
                      f"({hostile['accepted']})")
    growth = soak.rss.get("100%", 0) - soak.rss.get("10%", 0)
    if growth > a.max_rss_growth_mib << 20:
        broken.append(f"RSS grew {growth / 2**20:.1f} MiB between 10% and 100% "
                      f"(limit {a.max_rss_growth_mib} MiB)")
    return {
        "requests": len(soak.records),
        "expected": dict(EXPECTED),  # what each fault kind must end as
        "fault_kinds": list(FAULT_KINDS),
        "outcomes": dict(sorted(outcomes.items())),
        "reasons": dict(sorted(reasons.items())),
        "by_fault": {k: dict(v) for k, v in sorted(by_fault.items())},
        "pairs": pairs,
        "backpressure_retries": soak.backpressure,
        "hostile": hostile,
        "rss_bytes": soak.rss,
        "rss_growth_bytes": growth,
        "child_rss_bytes": soak.child_rss,
        "broken": broken,
        "records": [asdict(r) for r in soak.records] if a.json else [],
    }


# -- CLI ----------------------------------------------------------------------------------------


def _reason_key(reason: str) -> str:
    """A reason without request-specific numbers, for counting."""
    head = reason.split(":")[0] if reason.startswith(("PeerError", "TransportError")) else reason
    return "".join("N" if c.isdigit() else c for c in head)[:90]


def print_report(rep: dict[str, Any], args: argparse.Namespace, wall_s: float) -> None:
    print(f"python -m bench.soak: {rep['requests']} requests in {wall_s:.1f} s, seed {args.seed}, "
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
    h = rep["hostile"]
    tried = ", ".join(f"{k} {v}" for k, v in h["tried"].items())
    print(f"hostile client (holds the key, rate {h['rate']}): tried {h['forged_tried']} "
          f"forged state changes ({tried}); forged state changes accepted: "
          f"{h['forged_accepted']}")
    if rep["broken"]:
        print("\nINVARIANTS BROKEN:")
        for b in rep["broken"]:
            print(f"  - {b}")
    else:
        print("\nall invariants hold: every request accounted for, no leaked blocks, "
              "no open handles, RSS flat")
