"""Two network namespaces joined by a veth pair, for benches and tests (root only).

`Pair(tag)`: namespaces ``kvb-p-<tag>`` (prefill, ``10.79.0.1/24``) and ``kvb-d-<tag>``
(decode, ``10.79.0.2/24``), the veth ends created inside them (never a link in this
namespace), every packet on that pair, as `tests/system/test_netns.py` builds them.
``up()`` builds, ``popen(ns, argv)`` starts a process inside one, ``shape(...)`` puts a
``tc netem`` delay and rate cap on both ends (a ``tbf`` rate cap where the kernel has no
netem), ``close()`` kills what was started there and
deletes both namespaces (idempotent; also registered with ``atexit``).
`unavailable()` says why this machine cannot (None if it can), probed for real.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFILL_IP, DECODE_IP = "10.79.0.1", "10.79.0.2"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be built here (None if they can)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run as root)"
    if shutil.which("ip") is None:
        return "needs `ip` from iproute2 (apt-get install iproute2)"
    probe = f"kvb-probe-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without UCX_* (a child chooses its own) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return env | {"PYTHONUNBUFFERED": "1"} | (extra or {})


@dataclass
class Pair:
    tag: str = field(default_factory=lambda: f"{os.getpid()}")
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    closed: bool = False

    @property
    def p(self) -> str:
        return f"kvb-p-{self.tag}"

    @property
    def d(self) -> str:
        return f"kvb-d-{self.tag}"

    @property
    def veth_p(self) -> str:
        return f"kbp{self.tag}"[:15]

    @property
    def veth_d(self) -> str:
        return f"kbd{self.tag}"[:15]

    def up(self) -> Pair:
        atexit.register(self.close)
        _run("ip", "netns", "add", self.p)
        _run("ip", "netns", "add", self.d)
        _run("ip", "link", "add", self.veth_p, "netns", self.p, "type", "veth",
             "peer", "name", self.veth_d, "netns", self.d)
        _run("ip", "-n", self.p, "addr", "add", f"{PREFILL_IP}/24", "dev", self.veth_p)
        _run("ip", "-n", self.d, "addr", "add", f"{DECODE_IP}/24", "dev", self.veth_d)
        for ns, dev in ((self.p, self.veth_p), (self.d, self.veth_d)):
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", dev, "up")
        return self

    def popen(self, ns: str, argv: Sequence[str], *, env: dict[str, str],
              stdout: int | None = None, log: str | None = None) -> subprocess.Popen[bytes]:
        """``argv`` inside namespace ``ns`` (output to ``log`` when given)."""
        cmd = ["ip", "netns", "exec", ns, *argv]
        if log is not None:
            with open(log, "wb") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        else:
            proc = subprocess.Popen(cmd, stdout=stdout, env=env)
        self.procs.append(proc)
        return proc

    def tx_bytes(self) -> int:
        """Bytes the prefill end of the veth has sent."""
        path = f"/sys/class/net/{self.veth_p}/statistics/tx_bytes"
        return int(_run("ip", "netns", "exec", self.p, "cat", path).stdout)

    def shape(self, *, delay_ms: float, rate_mbit: float, limit: int = 100_000) -> str:
        """``tc netem`` on both ends: ``delay_ms`` each way, at most ``rate_mbit``. A kernel
        without netem (``sch_netem``) gets a ``tbf`` rate cap and no delay. Returns the
        qdisc used ("netem" or "tbf")."""
        kind = "netem"
        for ns, dev in ((self.p, self.veth_p), (self.d, self.veth_d)):
            base = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root"]
            if kind == "netem":
                made = _run(*base, "netem", "delay", f"{delay_ms}ms", "rate",
                            f"{rate_mbit}mbit", "limit", str(limit), check=False)
                if made.returncode == 0:
                    continue
                kind = "tbf"
            _run(*base, "tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency",
                 "400ms")
        return kind

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for ns in (self.p, self.d):
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                # only processes this bench started inside its own namespace
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)
