"""Per-request floor inside vLLM: the connector's copy call vs its own run copies.

gemma-3-1b's shapes laid out as vLLM 0.32.0 allocates them (26 layer names, 7 KV cache
groups overlaid on 4 tensors of one int8 backing buffer, ``[num_blocks, 1, 16, 512]`` bf16
views; `bench.vllm_connector.vllm_device_caches`), wrapped and given a host buffer as the
connector does (`bench.vllm_connector.connector_engine`: `wrap_vllm_caches`, the
block-major ``HostBuffer.for_device``, one `CopyEngine`). The ids are a request's: ``n``
ids 1..n split over the 7 groups (one contiguous run, as in ``kvstage bench copy
--floor``). Steps, per direction:

- ``connector``: the request's copy as the connector's roles run it
  (`bench.vllm_connector.connector_copy`: d2h as ``PrefillWorker.save``, ids per group
  validated -> plan -> CopyEngine.run; h2d as the decode's loader, runs -> copy_runs);
- ``copy_runs``: `CopyEngine.copy_runs` of the runs (the connector's copy minus building
  the runs and, for d2h, the ids' checks and the plan);
- ``views + copy``: the runs' ``copy_`` calls through views made at call time;
- ``copies alone``: the same runs' ``copy_`` calls between views sliced beforehand;
- ``before`` (with ``--baseline-src DIR``): the earlier connector's ``BlockCopier`` from
  ``DIR/kvstage/integrations/vllm/host_buffers.py`` (e.g. ``git worktree add /tmp/kv-before
  <commit>``), over the same device tensors and that module's own mirrored host buffers.

Every step runs in random order per round right after an untimed copy of the same bytes
(`kvstage.bench.report.time_interleaved`), so each starts from the same cache state;
medians. ``ratio`` = connector / copies alone (the floor target: <= 1.35).

    .venv-vllm/bin/python -m bench.vllm_floor --threads 1 [--ids 9 64] [--iters 2000]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.vllm_connector import GEMMA3_1B, connector_copy, connector_engine, vllm_device_caches
from kvstage.bench.report import make_timer, time_interleaved
from kvstage.engine import Direction


def request_ids(n: int, num_groups: int) -> list[list[int]]:
    """ids 1..n split over the groups, one list per group."""
    per, extra = divmod(n, num_groups)
    ids: list[list[int]] = []
    nxt = 1
    for g in range(num_groups):
        k = per + (g < extra)
        ids.append(list(range(nxt, nxt + k)))
        nxt += k
    return ids


def load_block_copier(src: str) -> Any:
    """The earlier connector's module (its ``BlockCopier`` and ``mirror_host_buffers``)."""
    path = Path(src) / "kvstage" / "integrations" / "vllm" / "host_buffers.py"
    spec = importlib.util.spec_from_file_location("kvstage_before_host_buffers", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline-src {src}: no {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "BlockCopier") or not hasattr(mod, "mirror_host_buffers"):
        raise SystemExit(f"--baseline-src {src}: {path} has no BlockCopier")
    return mod


def measure(n: int, iters: int, warmup: int, before_mod: Any) -> list[dict[str, Any]]:
    m = GEMMA3_1B
    device = vllm_device_caches(m, n + 2)
    for t in device.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32))
    eng = connector_engine(m, device)
    ids = request_ids(n, len(m.group_sizes))
    flat = [b for g in ids for b in g]
    runs = [(s, k) for s, _, k in eng.plan(ids, trusted=True).run_list]
    old_host = before_mod.mirror_host_buffers(device) if before_mod is not None else None
    rows = []
    for direction in ("h2d", "d2h"):
        pairs = []
        for dev_v, hst_v, dim in eng._pairs:
            for s, k in runs:
                d, h = dev_v.narrow(dim, s, k), hst_v.narrow(dim, s, k)
                pairs.append((d, h) if direction == "h2d" else (h, d))

        def copies(pairs: list[tuple[torch.Tensor, torch.Tensor]] = pairs) -> None:
            for d, s in pairs:
                d.copy_(s)

        how = Direction.H2D if direction == "h2d" else Direction.D2H

        def views_copy(direction: str = direction) -> None:
            for dev_v, hst_v, dim in eng._pairs:
                for s, k in runs:
                    d, h = dev_v.narrow(dim, s, k), hst_v.narrow(dim, s, k)
                    (d.copy_(h) if direction == "h2d" else h.copy_(d))

        fns: dict[str, Callable[[], Any]] = {
            "connector": partial(connector_copy, eng, ids, direction),
            "copy_runs": partial(eng.copy_runs, [(s, s, k) for s, k in runs], how),
            "views + copy": views_copy,
            "copies alone": copies,
        }
        if old_host is not None:
            src, dst = (old_host, device) if direction == "h2d" else (device, old_host)
            before = before_mod.BlockCopier(device, old_host)
            fns["before"] = partial(before, src, dst, flat, flat, direction)
        wall = make_timer(cuda=False)

        def warm(fn: Callable[[], Any], prep: Callable[[], None] = copies,
                 wall: Any = wall) -> int:
            prep()
            return wall(fn)

        samples = time_interleaved(fns, dict.fromkeys(fns, warm), warmup=warmup, iters=iters)
        med = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
        row = {"ids": n, "dir": direction, "runs": len(runs),
               "MiB": n * eng.layout.block_bytes / 2**20, **med,
               "ratio": med["connector"] / med["copies alone"]}
        if "before" in med:
            row["before ratio"] = med["before"] / med["copies alone"]
        rows.append(row)
        print(f"[floor] {n} ids {direction} done", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, nargs="+", default=[9, 64])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--baseline-src", default=None,
                        help="a kvstage src/ whose connector still has BlockCopier")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before_mod = load_block_copier(args.baseline_src) if args.baseline_src else None
    rows: list[dict[str, Any]] = []
    for n in args.ids:
        rows += measure(n, args.iters, args.warmup, before_mod)
    cols = ["ids", "dir", "runs", "MiB", "connector", "copy_runs", "views + copy",
            "copies alone", "ratio"]
    if before_mod is not None:
        cols += ["before", "before ratio"]
    print(f"torch {torch.__version__}, {args.threads} thread(s), median us of {args.iters} "
          "interleaved rounds")
    timed = ("connector", "copy_runs", "views + copy", "copies alone", "before")
    print("| " + " | ".join(c + (" us" if c in timed else "") for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:.2f}" if "ratio" in c or c == "MiB" else
                         f"{v:.1f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
