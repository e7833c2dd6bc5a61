"""A slow link between two namespaces (long suite): ``tc netem`` delay and a rate cap on the
veth pair, `kvstage prefill --listen` in one namespace and `kvstage decode --connect` in
the other, UCX over tcp with kvstage's off-loopback defaults (issue 37 item 3).

Checks:
- at the capped rate every request decodes its own KV (bytes verified against its seed),
  each READ takes at least its bytes over the cap (the link, not CMA, carried them) and the
  READs together reach at least half the cap (measured 24.0 MB/s of 25 with tbf: a loose
  bound that catches a READ stalling per round trip, not noise);
- a READ that would outlive the prefill's lease (the cap lowered under a request too big
  for the lease) fails as a timeout before the lease ends (the decode refuses a READ
  timeout that is not below the lease) instead of reading blocks the prefill may have
  handed to another request, and the requests after it, with the link back at the cap,
  are byte-exact again.

Needs root, ``ip netns`` and ``tc`` (`bench.netns`); skipped otherwise. A kernel without
``sch_netem`` (this VM's) gets the rate cap from ``tbf`` and no delay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import netns

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.nixl]

PORT = 5610
LAYOUT = ["--preset", "gemma-3-1b", "--num-blocks", "1024"]
KEY = "slow-link-test-key-" + "0" * 16
DELAY_MS = 5.0  # each way: a 10 ms round trip
RATE_MBIT = 200.0  # 25 MB/s: a 1024-token request (16.4 MiB) is >= 0.69 s on the link
SLOWER_MBIT = 40.0  # 5 MB/s: an 8192-token request (44.4 MiB) needs >= 9.3 s
LEASE_S = 6.0
READ_TIMEOUT_S = "5"  # a decode refuses a READ timeout that is not below the lease


class Link:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.pair = netns.Pair(f"t{os.getpid()}")
        self.env = netns.child_env({"KVSTAGE_KEY": KEY})
        self.prefill: subprocess.Popen[bytes] | None = None
        self.qdisc = ""  # "netem" (delay and rate) or "tbf" (rate only: no sch_netem)

    def start_prefill(self) -> None:
        log = self.tmp / "prefill.log"
        self.prefill = self.pair.popen(
            self.pair.p, [sys.executable, "-m", "kvstage.cli", "prefill", "--listen",
                          f"{netns.PREFILL_IP}:{PORT}", *LAYOUT, "--lease-s", str(LEASE_S)],
            env=self.env, log=str(log))
        deadline = time.monotonic() + 60
        while "kvstage prefill ucx:" not in log.read_text():
            assert self.prefill.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"prefill not ready: {log.read_text()}"
            time.sleep(0.1)

    def decode(self, name: str, *args: str) -> tuple[int, str, list[dict[str, Any]]]:
        log, rows = self.tmp / f"{name}.log", self.tmp / f"{name}.json"
        proc = self.pair.popen(
            self.pair.d, [sys.executable, "-m", "kvstage.cli", "decode", "--connect",
                          f"{netns.PREFILL_IP}:{PORT}", *LAYOUT, "--json", str(rows),
                          "--read-timeout-s", READ_TIMEOUT_S, *args],
            env=self.env, log=str(log))
        rc = proc.wait(120)
        data = json.loads(rows.read_text()) if rows.exists() else []
        return rc, log.read_text(), data

    def prefill_log(self) -> str:
        return (self.tmp / "prefill.log").read_text()


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Link]:
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    lk = Link(tmp_path)
    try:
        lk.pair.up()
        try:
            lk.qdisc = lk.pair.shape(delay_ms=DELAY_MS, rate_mbit=RATE_MBIT)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"neither tc netem nor tbf works here: {exc.stderr}")
        lk.start_prefill()
        yield lk
    finally:
        lk.pair.close()


@pytest.mark.timeout(300)
def test_slow_link_reads_fill_the_cap_and_the_lease_holds(link: Link) -> None:
    assert "UCX_TLS=tcp (auto" in link.prefill_log()
    assert "UCX_TCP_TX_SEG_SIZE=" in link.prefill_log()
    cap = RATE_MBIT * 1e6 / 8  # bytes per second
    before = link.pair.tx_bytes()
    rc, out, rows = link.decode("capped", "--requests", "4", "--prompt-tokens", "1024", "512")
    assert rc == 0, out
    assert "4/4 requests verified byte-exact" in out, out
    assert all(r["verified"] and r["status"] == "done" for r in rows), rows
    total = sum(int(r["nbytes"]) for r in rows)
    assert link.pair.tx_bytes() - before >= total  # every byte crossed the shaped veth
    for r in rows:
        floor_ms = int(r["nbytes"]) / cap * 1e3
        assert float(r["read_ms"]) >= 0.97 * floor_ms, r
    read_s = sum(float(r["read_ms"]) for r in rows) / 1e3
    assert total / read_s >= cap / 2, f"READ {total / read_s / 1e6:.1f} MB/s, cap {cap / 1e6}"

    # a READ longer than the lease: the link at SLOWER_MBIT under an 8192-token request
    link.pair.shape(delay_ms=DELAY_MS, rate_mbit=SLOWER_MBIT)
    t0 = time.monotonic()
    rc, out, rows = link.decode("lease", "--requests", "1", "--prompt-tokens", "8192")
    took = time.monotonic() - t0
    assert rc == 1, out
    (row,) = rows
    assert row["status"] == "failed" and "timed out" in str(row["reason"]), out
    assert took < 40, f"the READ was not cut before the lease's end ({took:.1f} s)"
    link.pair.shape(delay_ms=DELAY_MS, rate_mbit=RATE_MBIT)
    time.sleep(LEASE_S)  # the expired hold is freed; its blocks go to the next requests
    rc, out, rows = link.decode("after", "--requests", "3", "--prompt-tokens", "1024")
    assert rc == 0 and "3/3 requests verified byte-exact" in out, out
    assert link.prefill is not None
    link.prefill.send_signal(signal.SIGTERM)
    assert link.prefill.wait(30) == 0, link.prefill_log()
    stopped = [ln for ln in link.prefill_log().splitlines() if "prefill stopped" in ln]
    assert stopped and "completed=7" in stopped[0], link.prefill_log()
