"""The two ends of one `python -m bench.transfer` run (`Bench`): the prefill (a child on
127.0.0.1, or a ``--listen`` peer reached with ``--connect``), this process's registered
block-major host buffer and NIXL agent, and the descriptor lists of each READ method.
What the READ timings (`bench.transfer`) and the posting costs
(`bench.posting`) share. One thread; `Bench.close` gives back what it holds.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from typing import Any

import numpy as np

from kvstage.blocks import GroupedBlockIds
from kvstage.cache import HostBuffer, HostLayout, KVCache
from kvstage.cli import args as cli_args
from kvstage.cli import net
from kvstage.engine import CopyEngine
from kvstage.pd import messages as m
from kvstage.pd.side_channel import SideChannelClient, parse_address
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.transport.base import TransferState, Transport, wait

METHODS = ("merged", "per_block", "one_large")
READ_TIMEOUT_S = 30.0
NOTIF = b"kvstage-bench-transfer"  # not a request id: prefill counts it as unknown
# the bench holds its request for every iteration: a lease that outlives any run
BENCH_LEASE_S = 3600.0


class Bench:
    """The prefill child, our host buffer and NIXL agent, and the remote's address."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvstage.testing.servers import PrefillProcess  # spawns a child: only when run

        self.args = args
        self.layout = preset(args.preset, num_blocks=args.num_blocks)
        self.host = HostBuffer(self.layout, HostLayout.BLOCK_MAJOR)
        self.cache = KVCache(self.layout, "cpu")
        self.engine = CopyEngine(self.cache, self.host)
        self.proc: PrefillProcess | None = None
        if args.connect:
            self.address = parse_address(args.connect)
            net.probe(*self.address)  # refused / unreachable: a clear error, no wait
        else:
            self.proc = PrefillProcess(self.layout, transport="nixl", lease_s=BENCH_LEASE_S)
            self.address = self.proc.wait_ready()
        self.ucx = cli_args.setup_ucx(args, self.address[0])
        self.transport: Transport | None = None
        # request ids prefill holds for us -> their capability: released at close
        self.held: dict[str, bytes] = {}
        self.tag = uuid.uuid4().hex[:8]  # a listener outlives runs: wire ids unique per run
        self.posting_rows: list[dict[str, Any]] = []
        try:
            key = cli_args.key_from_args(args, self.address[0], "bench transfer")
            self.client = SideChannelClient(*self.address, timeout_s=30.0, key=key)
            from kvstage.transport import make_transport

            self.transport = make_transport("nixl", f"bench-{uuid.uuid4().hex[:8]}")
            self.transport.register(self.host.data_ptr, self.host.nbytes)
            meta = self.client.call(m.GetMeta(engine_id=self.transport.name))
            assert isinstance(meta, m.Meta)
            self.layout.check_compatible(m.layout_from_msg(meta.layout))
            if meta.host_layout != HostLayout.BLOCK_MAJOR.value:
                raise ValueError(f"prefill host layout is {meta.host_layout}, need block_major")
            self.peer = self.transport.add_peer(meta.agent_metadata)
            self.shift = meta.host_base - self.host.data_ptr
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        try:
            if self.proc is None:  # a remote listener: give back what this run holds there
                for rid in sorted(self.held):
                    with contextlib.suppress(Exception):
                        self.release(rid)
            if self.transport is not None:
                self.transport.close()
        finally:
            if self.proc is not None:  # the child goes whatever failed above
                self.proc.stop()

    def prefill(self, rid: str, tokens: int, seed: int) -> list[list[int]]:
        wire = f"{rid}-{self.tag}"
        done = self.client.call(m.PrefillRequest(request_id=wire, num_tokens=tokens, seed=seed))
        if not isinstance(done, m.PrefillDone):
            raise RuntimeError(f"prefill refused request {wire!r}: {done}")
        self.held[rid] = done.capability
        return done.block_ids

    def release(self, rid: str) -> None:
        capability = self.held.pop(rid, b"")
        self.client.call(m.Release(request_id=f"{rid}-{self.tag}", capability=capability))

    # -- descriptor lists -----------------------------------------------------------------
    def descriptors(self, method: str, runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) ``[N, 2]`` for one method; ``runs`` is ``[R, 3]`` (src, dst, n)."""
        lay, host = self.layout, self.host
        if method == "merged":
            local = host.descriptors(runs[:, 1], runs[:, 2])
            remote = host.descriptors(runs[:, 0], runs[:, 2])
        elif method == "per_block":
            src = np.concatenate([np.arange(s, s + n) for s, _, n in runs])
            dst = np.concatenate([np.arange(d, d + n) for _, d, n in runs])
            regions = lay.num_tensors * lay.num_planes
            plane = lay.page_size_bytes // lay.num_planes
            # block-major row = [T, P, E]: region r of block b is at b * row + r * plane
            offs = np.arange(regions, dtype=np.int64)[:, None] * plane

            def rows(blocks: np.ndarray) -> np.ndarray:
                addr = (host.data_ptr + blocks[None, :] * lay.block_bytes + offs).reshape(-1)
                return np.stack((addr, np.full_like(addr, plane)), axis=1)

            local, remote = rows(dst), rows(src)
        elif method == "one_large":
            nblocks = int(runs[:, 2].sum())
            one = np.array([[1], [nblocks]], dtype=np.int64)  # blocks [1, 1 + n)
            local = host.descriptors(one[0], one[1])
            remote = local.copy()
        else:
            raise ValueError(f"unknown method {method!r}; choose one of {list(METHODS)}")
        remote = remote.copy()
        remote[:, 0] += self.shift
        return local.astype(np.int64), remote.astype(np.int64)

    def read_once(self, local: np.ndarray, remote: np.ndarray) -> int:
        """One READ to DONE; returns its nanoseconds (raises if it did not finish)."""
        assert self.transport is not None
        start = time.perf_counter_ns()
        handle = self.transport.read(self.peer, local, remote, NOTIF)
        state = wait(self.transport, handle, READ_TIMEOUT_S, poll_interval_s=0.0)
        elapsed = time.perf_counter_ns() - start
        self.transport.release(handle)
        if state is not TransferState.DONE:
            raise RuntimeError(f"READ of {len(local)} descriptors ended {state.value}")
        return elapsed

    def verify(self, descs: tuple[np.ndarray, np.ndarray], local_ids: list[list[int]],
               seed: int) -> bool:
        """Zero our host buffer, READ once, load to the cache, compare every byte."""
        self.host.storage.zero_()
        self.read_once(*descs)
        self.engine.load_to_device(GroupedBlockIds(local_ids, self.layout))
        return verify_request(self.cache, local_ids, seed) == []
