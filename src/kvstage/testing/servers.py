"""Stand-alone P/D roles for the CLI, demo, benches and tests, and background prefills.

- `make_prefill` / `make_decode`: the library roles over a cache and `BlockPool` that
  kvstage allocates (no engine), with the verifiable pattern as the forward pass.
- `PrefillThread`: a prefill served from a daemon thread of this process.
- `PrefillProcess`: a prefill in a spawned child process, with ONE orphan guard: the
  child asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG) and also
  watches its parent's pid, so a crashed test or bench never leaves a NIXL agent
  spinning a core.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from kvstage.blocks import BlockPool
from kvstage.cache import HostLayout, KVCache
from kvstage.layout import KVLayout
from kvstage.pd.decode import DEFAULT_READ_TIMEOUT_S, DecodeWorker
from kvstage.pd.prefill import DEFAULT_LEASE_S, PrefillWorker
from kvstage.pd.side_channel import DEFAULT_HOST, DEFAULT_TIMEOUT_S
from kvstage.testing.pattern import PatternProducer
from kvstage.transport import make_transport

CHILD_START_S = 90.0


def make_prefill(
    layout: KVLayout,
    *,
    transport: str = "nixl",
    device: str = "cpu",
    host_layout: HostLayout | str = HostLayout.BLOCK_MAJOR,
    lease_s: float = DEFAULT_LEASE_S,
    host: str = DEFAULT_HOST,
    port: int = 0,
    engine_id: str | None = None,
    transport_options: dict[str, Any] | None = None,
    key: bytes | None = None,
    insecure: bool = False,
    max_hold_s: float | None = None,
    verify_checksum: bool = False,
) -> PrefillWorker:
    """A prefill role over kvstage's own cache and pool, writing the pattern as KV
    (``key``, ``insecure``, ``max_hold_s``: see `PrefillWorker`). The NIXL agent keeps
    its progress thread, which sleeps while idle (`kvstage.transport.nixl_agent`).
    Without a thread (``transport_options={"progress_thread": False}``, where
    `PrefillWorker.serve_once` drives UCX) the CLI prefill died with SIGSEGV after a
    SIGTERMed decode peer in netns runs (RELIABILITY.md "What is not covered")."""
    cache = KVCache(layout, device)
    pool = BlockPool(layout.num_blocks)
    eid = engine_id or f"prefill-{os.urandom(4).hex()}"
    options = ({"progress_thread": True} if transport == "nixl" else {}) | dict(
        transport_options or {})
    return PrefillWorker(
        cache, make_transport(transport, eid, **options),
        host_layout=HostLayout(host_layout), lease_s=lease_s, host=host, port=port,
        engine_id=eid, pool=pool, producer=PatternProducer(cache, pool), key=key,
        insecure=insecure, max_hold_s=max_hold_s, verify_checksum=verify_checksum,
    )


def make_decode(
    layout: KVLayout,
    *,
    transport: str = "nixl",
    device: str = "cpu",
    host_layout: HostLayout | str = HostLayout.BLOCK_MAJOR,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    handshake_timeout_s: float = DEFAULT_TIMEOUT_S,
    engine_id: str | None = None,
    transport_options: dict[str, Any] | None = None,
    key: bytes | None = None,
    verify_checksum: bool = False,
    pipeline: bool = False,
    any_pool_size: bool = False,
) -> DecodeWorker:
    """A decode role over kvstage's own cache, allocating local ids from its own pool."""
    eid = engine_id or f"decode-{os.urandom(4).hex()}"
    return DecodeWorker(
        KVCache(layout, device), make_transport(transport, eid, **(transport_options or {})),
        host_layout=HostLayout(host_layout), read_timeout_s=read_timeout_s,
        handshake_timeout_s=handshake_timeout_s, engine_id=eid,
        pool=BlockPool(layout.num_blocks), key=key, verify_checksum=verify_checksum,
        pipeline=pipeline, any_pool_size=any_pool_size,
    )


class PrefillThread:
    """Serve ``worker`` from a daemon thread; `stop` joins it and closes the worker.
    While it serves, the worker belongs to that thread (`PrefillWorker` is not
    thread-safe): save and hold before starting it, or talk to it over the side channel."""

    def __init__(self, worker: PrefillWorker, *, poll_s: float = 0.002) -> None:
        self.worker = worker
        self.address = worker.address
        self._thread = threading.Thread(target=worker.serve_forever, kwargs={"poll_s": poll_s},
                                        daemon=True, name=f"serve-{worker.engine_id}")
        self._thread.start()

    def stop(self) -> None:
        self.worker.stop()
        self._thread.join(10)
        self.worker.close()

    def __enter__(self) -> PrefillThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def die_with_parent() -> None:
    """In a child: SIGTERM when the parent dies, however it dies (Linux; elsewhere the
    parent-pid watch of the serve loop is the guard)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _serve_child(conn: Connection, layout: KVLayout, options: dict[str, Any],
                 parent_pid: int) -> None:
    """Spawned child: a prefill served until "stop", SIGTERM, or the parent's death."""
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before the guard was armed
        return
    try:
        worker = make_prefill(layout, **options)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    try:
        conn.send(("ready", worker.address))
        while os.getppid() == parent_pid and not worker.stopped:
            worker.serve_once(0.005)
            try:
                if conn.poll() and conn.recv() == "stop":
                    break
            except (EOFError, OSError):  # the parent closed its end: stop
                break
    finally:
        worker.close()


class PrefillProcess:
    """A prefill (`make_prefill` options) in a spawned child process on 127.0.0.1.

    The constructor returns at once; `wait_ready` blocks (bounded) for the bound address,
    so several children start in parallel.
    """

    def __init__(self, layout: KVLayout, **options: Any) -> None:
        ctx = mp.get_context("spawn")
        self.layout = layout
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_child, daemon=True,
                                args=(child, layout, options, os.getpid()))
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

    def stop(self, timeout_s: float = 10.0) -> int | None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send("stop")
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.kill()
        self._conn.close()
        return self.proc.exitcode

    def __enter__(self) -> PrefillProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
