"""Per-request floor inside vLLM: the connector's copy call vs its own run copies.

gemma-3-1b's shapes laid out as vLLM 0.32.0 allocates them (26 layer names, 7 KV cache
groups overlaid on 4 tensors of one int8 backing buffer, ``[num_blocks, 1, 16, 512]`` bf16
views; `bench.vllm_connector.vllm_device_caches`), host buffers mirrored as the connector mirrors
them. The ids are what ``save_kv_to_host`` / ``sync_recved_kv_to_device`` pass: ``n`` ids
1..n split over the 7 groups and concatenated (one contiguous run, as in ``kvstage bench
copy --floor``). Steps, per direction:

- ``connector``: the op the connector installs as ``copy_blocks`` (`EngineCopyOp`: trusted
  ids -> plan -> CopyEngine.run), called as vLLM calls it;
- ``copy_runs``: `CopyEngine.copy_runs` of the runs (the op minus ``runs_of_ids`` and its
  checks);
- ``views + copy``: the runs' ``copy_`` calls through views made at call time;
- ``copies alone``: the same runs' ``copy_`` calls between views sliced beforehand;
- ``before`` (with ``--baseline-src DIR``): the earlier connector's ``BlockCopier`` from
  ``DIR/kvstage/integrations/vllm/host_buffers.py`` (e.g. ``git worktree add /tmp/kv-before
  <commit>``), over the same buffers.

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

from bench.vllm_connector import GEMMA3_1B, connector_op, vllm_device_caches
from kvstage.bench.report import make_timer, time_interleaved
from kvstage.engine import Direction
from kvstage.integrations.vllm.host_buffers import mirror_host_buffers


def request_ids(n: int, num_groups: int) -> list[int]:
    """ids 1..n split over the groups, concatenated group after group."""
    per, extra = divmod(n, num_groups)
    ids: list[int] = []
    nxt = 1
    for g in range(num_groups):
        k = per + (g < extra)
        ids += range(nxt, nxt + k)
        nxt += k
    return ids


def load_block_copier(src: str) -> Any:
    path = Path(src) / "kvstage" / "integrations" / "vllm" / "host_buffers.py"
    spec = importlib.util.spec_from_file_location("kvstage_before_host_buffers", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline-src {src}: no {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "BlockCopier"):
        raise SystemExit(f"--baseline-src {src}: {path} has no BlockCopier")
    return mod.BlockCopier


def measure(n: int, iters: int, warmup: int, copier_cls: Any) -> list[dict[str, Any]]:
    m = GEMMA3_1B
    device = vllm_device_caches(m, n + 2)
    for t in device.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32))
    host = mirror_host_buffers(device)
    op = connector_op(m, device, host)
    ids = request_ids(n, len(m.group_sizes))
    eng = op.engine
    runs = [(s, k) for s, _, k in op.engine.plan(
        [ids] + [[] for _ in range(op.layout.num_groups - 1)], trusted=True).run_list]
    rows = []
    for direction in ("h2d", "d2h"):
        src, dst = (host, device) if direction == "h2d" else (device, host)
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
            "connector": partial(op, src, dst, ids, ids, direction),
            "copy_runs": partial(eng.copy_runs, [(s, s, k) for s, k in runs], how),
            "views + copy": views_copy,
            "copies alone": copies,
        }
        if copier_cls is not None:
            before = copier_cls(device, host)
            fns["before"] = partial(before, src, dst, ids, ids, direction)
        wall = make_timer(cuda=False)

        def warm(fn: Callable[[], Any], prep: Callable[[], None] = copies,
                 wall: Any = wall) -> int:
            prep()
            return wall(fn)

        samples = time_interleaved(fns, dict.fromkeys(fns, warm), warmup=warmup, iters=iters)
        med = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
        page = device[next(iter(device))][0].nbytes  # one block of one layer
        row = {"ids": n, "dir": direction, "runs": len(runs),
               "MiB": n * op.layout.num_tensors * page / 2**20, **med,
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
    copier_cls = load_block_copier(args.baseline_src) if args.baseline_src else None
    rows: list[dict[str, Any]] = []
    for n in args.ids:
        rows += measure(n, args.iters, args.warmup, copier_cls)
    cols = ["ids", "dir", "runs", "MiB", "connector", "copy_runs", "views + copy",
            "copies alone", "ratio"]
    if copier_cls is not None:
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
