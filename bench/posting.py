"""READ posting cost for `python -m bench.transfer`: building a READ's handle per request
from descriptor lists (``initialize_xfer``: lists built and checked every time) vs from
rows of lists prepared once per peer (``prep_xfer_dlist`` + ``make_prepped_xfer``,
`NixlTransport.prepare` / `read_prepared`), for merged runs and per-block descriptors.
Nothing is transferred while timing; one prepared READ per method is checked byte-exact.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from bench.transfer_bench import NOTIF, READ_TIMEOUT_S, Bench
from kvstage.bench.report import Column, ratio
from kvstage.blocks import GroupedBlockIds
from kvstage.pd.reads import blocks
from kvstage.testing.pattern import verify_request
from kvstage.transport.base import TransferState, validate_descs, validate_read, wait


def posting(bench: Bench, mode: str, runs: np.ndarray, local_ids: list[list[int]],
            iters: int, seed: int) -> list[dict[str, Any]]:
    """READ posting cost per request (from the runs to a handle, nothing transferred),
    merged and per-block: descriptor lists built and checked per READ (``read``'s path,
    ``initialize_xfer``) vs indices into lists prepared once per peer (``read_prepared``'s
    path, ``make_prepped_xfer``)."""
    t: Any = bench.transport
    agent, lay = t._state.agent, bench.layout
    src = np.concatenate([np.arange(a, a + n) for a, _, n in runs.tolist()])
    dst = np.concatenate([np.arange(d, d + n) for _, d, n in runs.tolist()])
    regions = lay.num_tensors * lay.num_planes
    plane = lay.page_size_bytes // lay.num_planes
    every = np.arange(lay.num_blocks, dtype=np.int64)
    block_rows = bench.host.descriptors(every, np.ones_like(every))
    region_rows = np.stack((  # block-major order: row b * regions + r
        (bench.host.data_ptr + every[:, None] * lay.block_bytes
         + np.arange(regions)[None, :] * plane).reshape(-1),
        np.full(lay.num_blocks * regions, plane)), axis=1).astype(np.int64)
    rows: list[dict[str, Any]] = []
    for meth, prep_rows, pick in (
        ("merged", block_rows, lambda b: b),
        ("per_block", region_rows,
         lambda b: (b[None, :] * regions + np.arange(regions, dtype=np.int32)[:, None]
                    ).reshape(-1)),
    ):
        remote_rows = prep_rows.copy()
        remote_rows[:, 0] += bench.shift
        local_p, remote_p = t.prepare(None, prep_rows), t.prepare(bench.peer, remote_rows)
        li, ri = pick(dst).astype(np.int32), pick(src).astype(np.int32)
        local, remote = bench.descriptors(meth, runs)
        before, after = [], []
        for _ in range(iters):
            # what `read` does per request before the transfer: lists from the runs,
            # kvstage's checks, NIXL's lists and handle
            start = time.perf_counter_ns()
            lo, re = bench.descriptors(meth, runs)
            validate_read(lo, re)
            validate_descs(lo, t._state.regions, "local")
            x = agent.initialize_xfer("READ", t._dlist(lo), t._dlist(re), bench.peer, NOTIF)
            before.append(time.perf_counter_ns() - start)
            agent.release_xfer_handle(x)
            # what `read_prepared` (with `Poster`) does: block indices from the runs
            start = time.perf_counter_ns()
            x = agent.make_prepped_xfer("READ", t._state.preps[local_p],
                                        pick(blocks(runs, 1)), t._state.preps[remote_p],
                                        pick(blocks(runs, 0)), NOTIF)
            after.append(time.perf_counter_ns() - start)
            agent.release_xfer_handle(x)
        bench.host.storage.zero_()  # one prepared READ, every byte checked
        handle = t.read_prepared(bench.peer, local_p, li, remote_p, ri, NOTIF)
        ok = wait(t, handle, READ_TIMEOUT_S) is TransferState.DONE
        t.release(handle)
        bench.engine.load_to_device(GroupedBlockIds(local_ids, lay))
        ok = ok and verify_request(bench.cache, local_ids, seed) == []
        b_us, a_us = statistics.median(before) / 1e3, statistics.median(after) / 1e3
        rows.append({"ids": mode, "method": meth, "descriptors": len(local),
                     "before_us": b_us, "after_us": a_us, "x": ratio(b_us, a_us),
                     "verified": ok})
    return rows


POSTING_COLUMNS = [
    Column("ids", "ids", align="<"),
    Column("method", "descriptors", align="<"),
    Column("descriptors", "count"),
    Column("before_us", "initialize_xfer us", "{:.1f}"),
    Column("after_us", "make_prepped_xfer us", "{:.1f}"),
    Column("x", "x faster", "{:.1f}x"),
    Column("verified", "bytes", lambda v: "verified" if v else "MISMATCH", align="<"),
]
