"""One server process (a vLLM api_server or the router): start, wait ready, stop, kill.

Contract:
- An `Instance` owns one child started in its own process group (``start_new_session``),
  so everything it forks (vLLM's engine core, its workers) goes with it: `stop` sends
  SIGTERM to the group, waits ``grace`` seconds, then SIGKILLs it; `kill` is SIGKILL at
  once (a crash, for fault tests). Both wait for the child with a bound.
- `start` waits for ``GET <url><health_path>`` to answer 200 within ``timeout``; it raises
  `ServingError` with the log's tail when the child exits first or the time passes (and
  leaves nothing running). The child's stdout and stderr go to ``log_path`` (appended).
- ``argv``/``env`` are exactly what runs; `command_line` shows them as a shell line a user
  can paste. No vLLM import here: this module only spawns processes.
- Not thread-safe: one owner thread drives an instance.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

READY_POLL_S = 0.5
HEALTH_TIMEOUT_S = 2.0


class ServingError(RuntimeError):
    """A server did not come up, died, or did not answer in time."""


def http_get(url: str, timeout: float = HEALTH_TIMEOUT_S, limit: int = 8 << 20) -> tuple[int,
                                                                                          bytes]:
    """``(status, body)`` of a GET (body capped at ``limit`` bytes); status 0 if unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (http only)
            return int(resp.status), resp.read(limit)
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read(limit)
    except (OSError, ValueError):
        return 0, b""


@dataclass(kw_only=True)
class Instance:
    """One server process: role is "prefill", "decode", "single" or "router"."""

    name: str
    role: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # set on top of os.environ
    unset_env: tuple[str, ...] = ()  # removed from the child's environment
    health_path: str = "/health"
    side_channel_port: int | None = None
    cores: tuple[int, ...] | None = None
    host: str = "127.0.0.1"  # the address it binds and peers use
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise ServingError(f"{self.name} is not running")
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command_line(self) -> str:
        """The environment overrides and the command, as one shell line."""
        unset = [f"-u {k}" for k in self.unset_env]
        assigns = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        prefix = " ".join(["env", *unset, *assigns]) + " " if unset or assigns else ""
        return prefix + shlex.join(self.argv)

    def spawn(self) -> Instance:
        """Start the process without waiting for it to be ready."""
        if self.alive:
            raise ServingError(f"{self.name} is already running (pid {self.pid})")
        env = dict(os.environ)
        for key in self.unset_env:
            env.pop(key, None)
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== kvstage: starting {self.name}: {self.command_line()}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
        return self

    def wait_ready(self, timeout: float) -> Instance:
        """Poll the health endpoint until it answers 200; `ServingError` otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            if self._proc is None or self._proc.poll() is not None:
                rc = None if self._proc is None else self._proc.returncode
                self._reap()
                raise ServingError(f"{self.name} exited (rc={rc}) before it was ready; "
                                   f"log {self.log_path} ends:\n{self.log_tail()}")
            status, _ = http_get(self.url + self.health_path)
            if status == 200:
                return self
            if time.monotonic() >= deadline:
                self.stop()
                raise ServingError(f"{self.name} not ready at {self.url}{self.health_path} "
                                   f"within {timeout:.0f} s; log {self.log_path} ends:\n"
                                   f"{self.log_tail()}")
            time.sleep(READY_POLL_S)

    def start(self, timeout: float = 300.0) -> Instance:
        return self.spawn().wait_ready(timeout)

    def restart(self, timeout: float = 300.0) -> Instance:
        self.stop()
        return self.start(timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group now."""
        self._signal_group(signal.SIGKILL)
        self._reap()

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the group, wait up to ``grace`` s, then SIGKILL it; idempotent."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=grace)
        # children of a cleanly exited leader may linger in the group: kill them too
        self._signal_group(signal.SIGKILL)
        self._reap()

    def log_tail(self, num_bytes: int = 6000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - num_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def _reap(self) -> None:
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired as exc:
            raise ServingError(f"{self.name} (pid {self._proc.pid}) survived SIGKILL for "
                               "30 s") from exc
        self._proc = None
