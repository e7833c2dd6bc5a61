"""`kvstage demo`: prefill -> decode over NIXL between processes on 127.0.0.1.

Spawns one `kvstage prefill` process per layout (gemma-3-1b: 7 KV cache groups over 4
tensors; llama-3.1-8b: uniform), runs the requests from this process as the decode
worker, verifies every byte on the decode device cache against what prefill wrote, and
prints a row per request. Exit code 1 on any mismatch or failure.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack

from kvstage.cache import HostLayout
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.handshake import parse_address
from kvstage.pd.roles import Row, print_rows, print_summary, run_one
from kvstage.presets import preset

START_TIMEOUT_S = 60.0
HYBRID_PROMPTS = [512, 1024, 2048, 4096, 8192]
UNIFORM_PROMPTS = [1024]


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child SIGTERMed when this process dies, however it
    dies (a crash or SIGKILL never reaches ``stop``; an orphaned NIXL agent would spin a
    core). prctl is looked up here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


class PrefillProcess:
    """A `kvstage prefill` child; its first stdout line gives the bound address.

    stdout is drained by a thread (so the child never blocks on a full pipe) and
    stderr goes to a temporary file that is shown if the child fails to start.
    """

    def __init__(self, preset_name: str, num_blocks: int, transport: str, lease_s: float) -> None:
        cmd = [sys.executable, "-m", "kvstage.cli", "prefill", "--listen", "127.0.0.1:0",
               "--preset", preset_name, "--num-blocks", str(num_blocks),
               "--transport", transport, "--lease-s", str(lease_s)]
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     text=True, env=env, preexec_fn=_die_with_parent())
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.address = self._wait_ready()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def _wait_ready(self) -> tuple[str, int]:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.05)
            except queue.Empty:
                if self.proc.poll() is not None:
                    self._stderr.seek(0)
                    raise RuntimeError(
                        f"prefill process exited with {self.proc.returncode}: "
                        f"{self._stderr.read()[-2000:]}"
                    ) from None
                continue
            if line.startswith("kvstage prefill listening on "):
                return parse_address(line.split()[4])
        self.stop()
        raise TimeoutError(f"prefill process not ready within {START_TIMEOUT_S} s")

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._stderr.close()
        return self.proc.returncode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="nixl", choices=["nixl", "loopback"],
                   help=argparse.SUPPRESS)
    p.add_argument("--read-timeout-s", type=float, default=10.0)


def run(args: argparse.Namespace) -> int:
    if args.transport != "nixl":
        print("kvstage demo moves bytes between processes: only --transport nixl works",
              file=sys.stderr)
        return 2
    plans = [("gemma-3-1b", 2048, HYBRID_PROMPTS), ("llama-3.1-8b", 160, UNIFORM_PROMPTS)]
    rows: list[Row] = []
    print("kvstage demo: prefill and decode processes on 127.0.0.1, NIXL (UCX) READ of the "
          "host buffers, every byte verified on the decode device cache\n", flush=True)
    with ExitStack() as stack:
        procs = []
        for name, blocks, _ in plans:
            proc = PrefillProcess(name, blocks, args.transport, lease_s=30.0)
            stack.callback(proc.stop)
            procs.append(proc)
        for (name, blocks, prompts), proc in zip(plans, procs, strict=True):
            layout = preset(name, num_blocks=blocks)
            with DecodeWorker(layout, transport=args.transport, host_layout=HostLayout.BLOCK_MAJOR,
                              read_timeout_s=args.read_timeout_s) as worker:
                worker.connect(*proc.address)
                for i, tokens in enumerate(prompts):
                    rid = f"{name.split('-')[0]}-{tokens}"
                    rows.append(run_one(worker, proc.address, rid, tokens, seed=100 + i,
                                        timeout_s=args.read_timeout_s))
    print_rows(rows)
    print_summary(rows)
    return 0 if rows and all(r.verified for r in rows) else 1
