"""Prefill -> decode over real NIXL (UCX, loopback): two processes where it matters.

Prefill runs in a child process (`PrefillProcess`, always stopped in a
``finally``) for the end-to-end, kill and CLI tests; the K/V-split cache layout and
the mirror host layout, which the CLI does not expose, use an in-process NIXL prefill
served from a daemon thread (two agents in one process still READ through UCX).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvstage.cache import HostLayout
from kvstage.layout import CacheLayout, KVLayout
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker, RequestResult
from kvstage.pd.prefill import PrefillWorker
from kvstage.pd.side_channel import SideChannelClient
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillProcess, PrefillThread, make_decode, make_prefill
from tests.helpers import stats_of, wait_for

pytestmark = pytest.mark.nixl

NUM_BLOCKS = 1024
GEMMA = preset("gemma-3-1b", num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def prefill_proc() -> Iterator[PrefillProcess]:
    """One shared `kvstage prefill` child for the tests that do not kill it."""
    proc = PrefillProcess(GEMMA, transport="nixl", lease_s=30.0)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@contextmanager
def decoder(layout: KVLayout = GEMMA, **kw: object) -> Iterator[DecodeWorker]:
    opts: dict[str, object] = {"read_timeout_s": 5.0, "handshake_timeout_s": 2.0} | kw
    worker = make_decode(layout, transport="nixl", **opts)  # type: ignore[arg-type]
    try:
        yield worker
    finally:
        worker.close()


@contextmanager
def in_process_prefill(layout: KVLayout, host_layout: HostLayout) -> Iterator[PrefillWorker]:
    with PrefillThread(make_prefill(layout, host_layout=host_layout, transport="nixl")) as srv:
        worker = srv.worker
        yield worker


def prefill_remote(addr: tuple[str, int], rid: str, tokens: int, seed: int) -> m.PrefillDone:
    done = SideChannelClient(*addr).call(
        m.PrefillRequest(request_id=rid, num_tokens=tokens, seed=seed))
    assert isinstance(done, m.PrefillDone)
    return done


def read(decode: DecodeWorker, addr: tuple[str, int], done: m.PrefillDone,
         local: list[list[int]] | None = None) -> RequestResult:
    """READ ``done`` into ``local`` (claimed from decode's pool for the READ, then given
    back: the caller allocates the ids it passes) or into ids the pool allocates."""
    assert decode.pool is not None
    for g in local or []:
        decode.pool.claim(g)
    try:
        res = decode.start(done.request_id, addr, done.block_ids, local,
                           capability=done.capability)
        if res.status == "pending":
            res = decode.wait(done.request_id, 2 * decode.read_timeout_s)
    finally:
        for g in local or []:
            decode.pool.free(g)
    return res


def assert_clean(decode: DecodeWorker) -> None:
    assert decode.pool.num_free == decode.layout.num_blocks - 1
    assert decode.transport.num_open_handles == 0
    assert decode.num_pending == 0 and decode.num_draining == 0


# -- end to end ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_two_process_hybrid_transfer_is_byte_exact(prefill_proc: PrefillProcess) -> None:
    addr = prefill_proc.address
    lay = GEMMA
    with decoder() as decode:
        for i, tokens in enumerate([512, 4096]):
            done = prefill_remote(addr, f"e2e-{tokens}", tokens, seed=11 + i)
            res = read(decode, addr, done)
            assert res.status == "done", res.reason
            assert verify_request(decode.cache, res.local_block_ids, 11 + i) == []
            assert res.nbytes == sum(map(len, done.block_ids)) * lay.block_bytes
            # fresh pools on both sides: one run, one descriptor for the whole request
            assert (res.num_runs, res.num_descriptors) == (1, 1)
            decode.finish(done.request_id)
        # scattered local ids: every pair is its own run, one descriptor each
        done = prefill_remote(addr, "e2e-scattered", 4096, seed=21)
        spare = iter(range(NUM_BLOCKS - 1, 0, -2))
        local = [[next(spare) for _ in g] for g in done.block_ids]
        res = read(decode, addr, done, local)
        blocks = sum(map(len, done.block_ids))
        assert res.status == "done", res.reason
        assert res.num_runs == blocks and res.num_descriptors == blocks
        assert verify_request(decode.cache, local, 21) == []
        # every READ's notification freed its prefill blocks
        wait_for(lambda: stats_of(addr).held_requests == 0)
        assert stats_of(addr).free_blocks == NUM_BLOCKS - 1
        assert_clean(decode)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("cache_layout", "host_layout"),
    [(CacheLayout.KV_SPLIT, HostLayout.BLOCK_MAJOR), (CacheLayout.KV_SPLIT, HostLayout.MIRROR),
     (CacheLayout.PACKED, HostLayout.MIRROR)],
    ids=["kv_split-block_major", "kv_split-mirror", "packed-mirror"],
)
def test_in_process_nixl_layouts(cache_layout: CacheLayout, host_layout: HostLayout) -> None:
    lay = preset("gemma-3-1b", num_blocks=NUM_BLOCKS, cache_layout=cache_layout)
    per_run = 1 if host_layout is HostLayout.BLOCK_MAJOR else lay.num_tensors * lay.num_planes
    with in_process_prefill(lay, host_layout) as prefill, \
            decoder(lay, host_layout=host_layout) as decode:
        addr = prefill.address
        done = prefill_remote(addr, "contig", 4096, seed=3)
        res = read(decode, addr, done)
        assert res.status == "done", res.reason
        assert (res.num_runs, res.num_descriptors) == (1, per_run)
        assert verify_request(decode.cache, res.local_block_ids, 3) == []
        decode.finish("contig")
        # scattered: runs of two blocks (pairs of ids, then a gap)
        done = prefill_remote(addr, "pairs", 512, seed=4)
        blocks = sum(map(len, done.block_ids))
        spare = [b for b in range(1, NUM_BLOCKS) if b % 3 != 0][:blocks]
        it = iter(spare)
        local = [[next(it) for _ in g] for g in done.block_ids]
        res = read(decode, addr, done, local)
        assert res.status == "done", res.reason
        assert res.num_runs == blocks // 2
        assert res.num_descriptors == res.num_runs * per_run
        assert verify_request(decode.cache, local, 4) == []
        assert_clean(decode)


# -- refusals -----------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_mismatched_layout_refused_by_a_real_prefill(prefill_proc: PrefillProcess) -> None:
    with decoder(preset("gemma-3-1b", num_blocks=512)) as decode, \
            pytest.raises(ValueError, match="num_blocks is 512 here, 1024 remote"):
        decode.connect(*prefill_proc.address)
    with decoder(host_layout=HostLayout.MIRROR) as decode, \
            pytest.raises(ValueError, match="host_layout is 'mirror' here"):
        decode.connect(*prefill_proc.address)


# -- failures -----------------------------------------------------------------------------
class _KillAfterAcquire:
    """A side-channel client that SIGKILLs the prefill once its Acquire was answered,
    so the READ that follows goes to a dead peer."""

    def __init__(self, inner: SideChannelClient, proc: PrefillProcess) -> None:
        self.inner, self.proc = inner, proc

    def call(self, msg: m.Message, **kw: float) -> m.Message:
        reply = self.inner.call(msg, **kw)
        if isinstance(msg, m.Acquire):
            self.proc.kill()
        return reply


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before_acquire", "before_read"])
def test_prefill_killed_fails_the_request_and_decode_recovers(
    when: str, prefill_proc: PrefillProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = PrefillProcess(GEMMA, transport="nixl", lease_s=30.0)
    victim.wait_ready()
    try:
        with decoder(read_timeout_s=3.0, handshake_timeout_s=1.0) as decode:
            addr = victim.address
            decode.connect(*addr)
            done = prefill_remote(addr, "doomed", 4096, seed=1)
            if when == "before_acquire":
                victim.kill()
            else:
                real = decode.client
                monkeypatch.setattr(decode, "client",
                                    lambda h, p: _KillAfterAcquire(real(h, p), victim))
            start = time.monotonic()
            res = read(decode, addr, done)
            elapsed = time.monotonic() - start
            assert not victim.proc.is_alive()  # it really died before the READ
            assert res.status == "failed" and res.reason
            if when == "before_acquire":
                assert res.code == "handshake_timeout"
            else:
                assert res.code in ("transport_failure", "read_failed"), res
            assert elapsed < decode.read_timeout_s + decode.handshake_timeout_s + 2
            assert_clean(decode)
            monkeypatch.undo()
            # the next request, to another (live) prefill, works
            fresh = prefill_proc.address
            done = prefill_remote(fresh, f"after-{when}", 512, seed=2)
            res = read(decode, fresh, done)
            assert res.status == "done", res.reason
            assert verify_request(decode.cache, res.local_block_ids, 2) == []
            decode.finish(done.request_id)
            assert_clean(decode)
    finally:
        victim.stop()


@pytest.mark.timeout(30)
def test_released_before_read_fails_naming_it(prefill_proc: PrefillProcess) -> None:
    addr = prefill_proc.address
    with decoder() as decode:
        done = prefill_remote(addr, "released", 512, seed=1)
        release = m.Release(request_id="released", capability=done.capability)
        assert isinstance(SideChannelClient(*addr).call(release), m.Ok)
        res = read(decode, addr, done)
        assert res.status == "failed"
        assert "Acquire" in res.reason and "not held" in res.reason
        assert_clean(decode)
        done = prefill_remote(addr, "then-ok", 512, seed=2)
        res = read(decode, addr, done)
        assert res.status == "done" and verify_request(decode.cache, res.local_block_ids, 2) == []
        decode.finish("then-ok")
        assert_clean(decode)


@pytest.mark.timeout(30)
def test_unknown_notification_is_reported(prefill_proc: PrefillProcess) -> None:
    addr = prefill_proc.address
    with decoder() as decode:
        remote = decode.connect(*addr)
        decode.transport.send_notif(remote.peer, b"bogus-request-id")
        wait_for(lambda: "bogus-request-id" in stats_of(addr).unknown_notifs)
        assert prefill_proc.proc.is_alive()  # still alive, still serving
        assert stats_of(addr).open_handles == 0


# -- the CLI ------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_demo_runs_and_verifies_everything() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstage.cli", "demo"], capture_output=True,
                         text=True, timeout=150)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "6/6 requests verified" in out.stdout


@pytest.mark.timeout(60)
def test_decode_cli_against_prefill_cli(prefill_proc: PrefillProcess) -> None:
    host, port = prefill_proc.address
    out = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "decode", "--connect", f"{host}:{port}",
         "--num-blocks", str(NUM_BLOCKS), "--requests", "2", "--prompt-tokens", "512", "1024"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "2/2 requests verified byte-exact" in out.stdout


@pytest.mark.timeout(30)
def test_decode_cli_exits_2_when_nothing_listens() -> None:
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "decode", "--connect", f"127.0.0.1:{port}",
         "--handshake-timeout-s", "0.5", "--num-blocks", "256"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"127.0.0.1:{port}" in out.stderr and "kvstage prefill --listen" in out.stderr


@pytest.mark.timeout(90)
def test_prefill_child_dies_with_a_killed_parent() -> None:
    # a parent that dies without stop() (SIGKILL, crash) must not leave its prefill child
    # behind: an orphaned NIXL agent would spin a core until someone noticed
    code = ("from kvstage.testing.servers import PrefillProcess; import sys, time; "
            "from kvstage.presets import preset; "
            "p = PrefillProcess(preset('llama-3.1-8b', num_blocks=16), transport='loopback'); "
            "print(p.proc.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive while the parent is
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, os.WNOHANG)  # not ours: reaped by init, normally
            time.sleep(0.1)
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"prefill child {child} outlived its killed parent by 30 s")
    finally:
        if parent.poll() is None:
            parent.kill()
