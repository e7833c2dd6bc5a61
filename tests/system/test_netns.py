"""Prefill and decode on two "hosts": network namespaces joined by a veth pair.

``kvs-p-<pid>`` holds 10.77.0.1/24 and runs ``kvstage prefill --listen 10.77.0.1:5600``;
``kvs-d-<pid>`` holds 10.77.0.2/24 and runs ``kvstage decode --connect 10.77.0.1:5600``.
Every packet stays on that veth pair. Checks: byte-exact results for the hybrid layout
with the READ's bytes counted on the link (so not CMA), refused/unreachable exit 2,
SIGTERM mid-READ aborts, a link cut mid-READ fails within the read timeout and the next
run after the link comes back succeeds, SIGTERM stops prefill cleanly.

Needs root and ``ip`` (iproute2) with working ``ip netns``; a slow link (``tc`` tbf) for
the mid-READ cases. Namespaces and processes are removed at the end, failed or not
(fixture ``finally`` and ``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.nixl]

PID = os.getpid()
PREFILL_IP, DECODE_IP, PORT = "10.77.0.1", "10.77.0.2", 5600
LAYOUT = ["--preset", "gemma-3-1b", "--num-blocks", "512"]
READ_TIMEOUT_S = 5.0
START_TIMEOUT_S = 60.0
SLOW_RATE = "40mbit"  # a 1024-token request (16.4 MiB) then takes ~3.5 s on the link


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=check)


def netns_unavailable() -> str | None:
    """Why this machine cannot build namespaces (None if it can): probed for real."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root)"
    if shutil.which("ip") is None:
        return "needs `ip` from iproute2 (apt-get install iproute2)"
    probe = f"kvs-probe-{PID}-{uuid.uuid4().hex[:6]}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


NETNS_KEY = "netns-test-key-" + "0" * 16


def _child_env() -> dict[str, str]:
    # UCX_* set in this process (NixlTransport's setdefault in other tests) would win
    # over the role commands' own choice, so children get none.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    # the roles bind and connect a non-loopback address: they need the shared key
    return env | {"PYTHONUNBUFFERED": "1", "KVSTAGE_KEY": NETNS_KEY}


@dataclass
class Net:
    tmp: Path
    p: str = f"kvs-p-{PID}"
    d: str = f"kvs-d-{PID}"
    veth_p: str = f"kvp{PID}"
    veth_d: str = f"kvd{PID}"
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    closed: bool = False

    def up(self) -> None:
        _run("ip", "netns", "add", self.p)
        _run("ip", "netns", "add", self.d)
        # both ends are created inside the namespaces: never a link in this one
        _run("ip", "link", "add", self.veth_p, "netns", self.p, "type", "veth",
             "peer", "name", self.veth_d, "netns", self.d)
        _run("ip", "-n", self.p, "addr", "add", f"{PREFILL_IP}/24", "dev", self.veth_p)
        _run("ip", "-n", self.d, "addr", "add", f"{DECODE_IP}/24", "dev", self.veth_d)
        for ns, dev in ((self.p, self.veth_p), (self.d, self.veth_d)):
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "up")

    def start(self, ns: str, *args: str, name: str) -> tuple[subprocess.Popen[str], Path]:
        """``kvstage ARGS`` in namespace ``ns``; stdout and stderr to a file."""
        out = self.tmp / f"{name}-{len(self.procs)}.log"
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvstage.cli", *args]
        with out.open("w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                    env=_child_env())
        self.procs.append(proc)
        return proc, out

    def decode(self, *args: str, timeout_s: float = 120.0) -> tuple[int, str, float]:
        proc, out = self.start(self.d, "decode", "--connect", f"{PREFILL_IP}:{PORT}",
                               *LAYOUT, *args, name="decode")
        t0 = time.monotonic()
        rc = proc.wait(timeout_s)
        return rc, out.read_text(), time.monotonic() - t0

    def tx_bytes(self) -> int:
        path = f"/sys/class/net/{self.veth_p}/statistics/tx_bytes"
        return int(_run("ip", "netns", "exec", self.p, "cat", path).stdout)

    def link(self, up: bool) -> None:
        _run("ip", "-n", self.p, "link", "set", self.veth_p, "up" if up else "down")
        if up:  # the peer end follows the carrier; wait until it is up again
            path = f"/sys/class/net/{self.veth_d}/operstate"
            deadline = time.monotonic() + 10
            while _run("ip", "netns", "exec", self.d, "cat", path).stdout.strip() != "up":
                assert time.monotonic() < deadline, "veth did not come back up"
                time.sleep(0.05)

    @contextlib.contextmanager
    def slow_link(self) -> Iterator[None]:
        dev = ["dev", self.veth_p, "root"]
        made = _run("ip", "netns", "exec", self.p, "tc", "qdisc", "add", *dev, "tbf",
                    "rate", SLOW_RATE, "burst", "64kb", "latency", "400ms", check=False)
        if made.returncode != 0:
            pytest.skip(f"cannot slow the link to cut it mid-READ (tc tbf): {made.stderr}")
        try:
            yield
        finally:
            _run("ip", "netns", "exec", self.p, "tc", "qdisc", "del", *dev, check=False)

    def close(self) -> None:
        """Idempotent: kill what we started, then delete the namespaces (and the veth)."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for ns in (self.p, self.d):
            pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # only ever processes this test started in its namespace
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    n = Net(tmp_path_factory.mktemp("netns"))
    atexit.register(n.close)
    try:
        n.up()
        yield n
    finally:
        n.close()


@dataclass
class Prefill:
    proc: subprocess.Popen[str]
    log: Path

    def text(self) -> str:
        return self.log.read_text()


@pytest.fixture(scope="module")
def prefill(net: Net) -> Prefill:
    proc, log = net.start(net.p, "prefill", "--listen", f"{PREFILL_IP}:{PORT}", *LAYOUT,
                          "--lease-s", "30", name="prefill")
    deadline = time.monotonic() + START_TIMEOUT_S
    while "kvstage prefill ucx:" not in log.read_text():
        assert proc.poll() is None, f"prefill exited {proc.returncode}: {log.read_text()}"
        assert time.monotonic() < deadline, f"prefill not ready: {log.read_text()}"
        time.sleep(0.1)
    return Prefill(proc, log)


def _rows(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if re.match(r"d\d{8}-\d+ ", ln)]


def _cut_when_reading(net: Net, proc: subprocess.Popen[str], action: str) -> float:
    """Wait until the READ has moved 2 MiB over the link, then act; returns the time."""
    start = net.tx_bytes()
    deadline = time.monotonic() + START_TIMEOUT_S
    while net.tx_bytes() - start < 2 << 20:
        assert proc.poll() is None, "decode ended before its READ got going"
        assert time.monotonic() < deadline, "the READ never started moving bytes"
        time.sleep(0.05)
    if action == "link down":
        net.link(up=False)
    else:
        proc.send_signal(signal.SIGTERM)
    return time.monotonic()


@pytest.mark.timeout(180)
def test_decode_across_namespaces_is_byte_exact(net: Net, prefill: Prefill) -> None:
    assert "UCX_TLS=tcp (auto" in prefill.text()
    assert f"UCX_NET_DEVICES={net.veth_p} (auto" in prefill.text()
    before = net.tx_bytes()
    rc, out, _ = net.decode("--requests", "4", "--prompt-tokens", "512", "1024")
    crossed = net.tx_bytes() - before
    assert rc == 0, out
    assert f"UCX_NET_DEVICES={net.veth_d} (auto" in out
    rows = _rows(out)
    assert len(rows) == 4 and all(r.endswith("ok, bytes verified") for r in rows), out
    assert "[33x6, 64]" in out, "the hybrid layout: six sliding-window groups capped at 33"
    assert "4/4 requests verified byte-exact" in out
    assert re.search(r"READ: [\d.]+ MiB in [\d.]+ ms = [\d.]+ GB/s", out), out
    for phase in ("d2h", "read", "h2d"):
        assert re.search(rf"{phase}: p50 [\d.]+ ms  p99 [\d.]+ ms", out), out
    # 2 x 14.0 + 2 x 16.4 MiB were READ: they crossed the veth, not CMA/shared memory
    assert crossed >= 60 << 20, f"only {crossed} bytes crossed the link"


@pytest.mark.timeout(120)
def test_refused_and_unreachable_exit_2(net: Net, prefill: Prefill) -> None:
    proc, log = net.start(net.d, "decode", "--connect", f"{PREFILL_IP}:{PORT + 1}", *LAYOUT,
                          name="refused")
    assert proc.wait(60) == 2
    assert "refused the connection: nothing listens on port" in log.read_text()
    proc, log = net.start(net.d, "decode", "--connect", f"10.77.0.3:{PORT}", *LAYOUT,
                          name="unreachable")
    assert proc.wait(60) == 2
    assert f"prefill at 10.77.0.3:{PORT} is unreachable" in log.read_text()
    proc, log = net.start(net.d, "decode", "--connect", f"{PREFILL_IP}:{PORT}",
                          "--preset", "gemma-3-1b", "--num-blocks", "1024", name="layout")
    assert proc.wait(60) == 2
    assert "incompatible layout" in log.read_text() and "--num-blocks" in log.read_text()


@pytest.mark.timeout(120)
def test_sigterm_mid_read_aborts_and_exits_nonzero(net: Net, prefill: Prefill) -> None:
    with net.slow_link():
        proc, log = net.start(net.d, "decode", "--connect", f"{PREFILL_IP}:{PORT}", *LAYOUT,
                              "--requests", "2", "--prompt-tokens", "1024", name="sigterm")
        t = _cut_when_reading(net, proc, "SIGTERM")
        rc = proc.wait(30)
    out = log.read_text()
    assert rc == 128 + signal.SIGTERM, out
    assert time.monotonic() - t < 10, "decode took too long to stop"
    assert "ABORTED: SIGTERM" in out
    assert "READ aborted, prefill asked to release its blocks" in out


@pytest.mark.timeout(180)
def test_link_cut_mid_read_fails_in_time_then_recovers(net: Net, prefill: Prefill) -> None:
    try:
        with net.slow_link():
            proc, log = net.start(net.d, "decode", "--connect", f"{PREFILL_IP}:{PORT}",
                                  *LAYOUT, "--requests", "1", "--prompt-tokens", "1024",
                                  "--read-timeout-s", str(READ_TIMEOUT_S),
                                  "--handshake-timeout-s", "3", name="cut")
            t = _cut_when_reading(net, proc, "link down")
            rc = proc.wait(60)
        took = time.monotonic() - t
        out = log.read_text()
        assert rc == 1, out
        (row,) = _rows(out)
        assert "FAILED: READ timed out" in row, out
        assert took < READ_TIMEOUT_S + 10, f"decode ended {took:.1f} s after the cut"
    finally:
        net.link(up=True)
    assert prefill.proc.poll() is None, "prefill died when the link dropped"
    # the cut request's 262 blocks stay held until its lease ends; 512 tokens fit
    rc, out, _ = net.decode("--requests", "2", "--prompt-tokens", "512")
    assert rc == 0, out
    assert "2/2 requests verified byte-exact" in out


@pytest.mark.timeout(60)
def test_prefill_sigterm_stops_cleanly(net: Net, prefill: Prefill) -> None:
    prefill.proc.send_signal(signal.SIGTERM)
    assert prefill.proc.wait(30) == 0, prefill.text()
    stopped = [ln for ln in prefill.text().splitlines() if ln.startswith("kvstage prefill stopped")]
    assert stopped, prefill.text()
    assert "held_at_stop=" in stopped[0]
