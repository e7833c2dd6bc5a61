"""`kvstage bench copy --floor`: the per-request CPU floor of a fused copy, step by step.

One request of gemma-3-1b (7 KV cache groups, 4 physical tensors, 16 KiB pages) with
``n`` ids 1..n split over the groups (one contiguous run), host -> device:

- ``GroupedBlockIds``: validating the per-group id lists (``trusted``: the checks skipped);
- ``plan_copy``: planning validated ids (``scattered``: ids 1, 3, 5, ... so n runs);
- ``load_to_device``: the whole request as a caller makes it, lists in, copies done;
- ``run planned``: `CopyEngine.run` of a plan made beforehand (views, copies, stats);
- ``copies alone``: one ``copy_`` per run between views sliced beforehand;
- ``overhead``: load_to_device minus copies alone, ``dispatch``: run planned minus copies
  alone, each the median of per-round differences (both run in every round).

Every step runs interleaved, in a random order per round (`time_interleaved`): the host-only steps
in rounds of their own (after a large copy a step's first touches miss the CPU caches,
which would charge it the previous step's traffic), the copy steps each right after an
untimed copy of the same bytes, so each starts from the same cache state. With
``--baseline-src DIR`` the kvstage package under ``DIR`` (e.g. ``git worktree add
/tmp/kv-before HEAD`` then ``/tmp/kv-before/src``) is imported beside this one and its
steps join the same rounds, so "before" and "after" share every disturbance.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kvstage.bench.report import (
    Column,
    Timer,
    make_timer,
    print_table,
    time_interleaved,
    write_json,
)

DEFAULT_IDS = [9, 64, 1000]
PRESET = "gemma-3-1b"
COPY_BYTES_CAP = 256 << 20  # above this a request's copy steps are skipped (plan only)
SMALL_BYTES = 4 << 20  # requests up to this size run --iters rounds; larger ones fewer


def load_package(src: str) -> ModuleType:
    """Import the ``kvstage`` package found in ``src`` beside the one already imported.

    Its modules are imported under their own names with ``src`` first on the path, then
    taken out of ``sys.modules`` again (the loaded code keeps its own references), so
    the current package is untouched.
    """
    root = Path(src).resolve()
    if not (root / "kvstage" / "__init__.py").is_file():
        raise SystemExit(f"--baseline-src {src}: no kvstage/__init__.py under it")
    saved = {k: m for k, m in sys.modules.items() if k == "kvstage" or k.startswith("kvstage.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        pkg = importlib.import_module("kvstage")
        for sub in ("blocks", "plan", "engine", "cache", "presets"):
            setattr(pkg, f"_{sub}", importlib.import_module(f"kvstage.{sub}"))
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "kvstage" or k.startswith("kvstage.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    if not str(Path(pkg.__file__ or "").resolve()).startswith(str(root)):
        raise SystemExit(f"--baseline-src {src}: imported {pkg.__file__} instead")
    return pkg


def _groups(ids: list[int], num_groups: int) -> list[list[int]]:
    return [a.tolist() for a in np.array_split(np.array(ids, dtype=np.int64), num_groups)]


def _steps(pkg: ModuleType, n: int, tag: str, current: bool
           ) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]], Any]:
    """The timed steps of one package at ``n`` ids, keyed ``"<step> <tag>"``: host-only
    steps, copy steps (empty above COPY_BYTES_CAP), and the copies-alone function."""
    blocks, plan, presets = pkg._blocks, pkg._plan, pkg._presets
    layout = presets.preset(PRESET, num_blocks=n + 2)
    groups = _groups(list(range(1, n + 1)), layout.num_groups)
    ids = blocks.GroupedBlockIds(groups, layout)
    wide = presets.preset(PRESET, num_blocks=2 * n + 2)
    scattered = blocks.GroupedBlockIds(
        _groups(list(range(1, 2 * n + 1, 2)), wide.num_groups), wide)
    host_steps: dict[str, Callable[[], Any]] = {
        f"GroupedBlockIds {tag}": lambda: blocks.GroupedBlockIds(groups, layout),
        f"plan_copy {tag}": lambda: plan.plan_copy(layout, ids),
        f"plan_copy scattered {tag}": lambda: plan.plan_copy(wide, scattered),
    }
    if current:
        host_steps[f"GroupedBlockIds trusted {tag}"] = lambda: blocks.GroupedBlockIds(
            groups, layout, trusted=True)
    if n * layout.block_bytes > COPY_BYTES_CAP:
        return host_steps, {}, None
    cache = pkg._cache.KVCache(layout)
    cache.fill_random(0)
    host = pkg._cache.HostBuffer(layout)
    engine = pkg._engine.CopyEngine(cache, host)
    dev, hst = cache.canonical, host.canonical
    runs = plan.plan_copy(layout, ids).runs.tolist()
    pairs = [(dev.narrow(2, d, k), hst.narrow(2, s, k)) for s, d, k in runs]

    def copies() -> None:
        for d, s in pairs:
            d.copy_(s)

    planned = plan.plan_copy(layout, ids)
    h2d = pkg._engine.Direction.H2D
    copy_steps: dict[str, Callable[[], Any]] = {
        f"load_to_device {tag}": lambda: engine.load_to_device(groups),
        f"run planned {tag}": lambda: engine.run(planned, h2d),
    }
    if current:
        copy_steps[f"load_to_device trusted {tag}"] = lambda: engine.load_to_device(
            groups, trusted=True)
    copy_steps[f"copies alone {tag}"] = copies
    return host_steps, copy_steps, copies


def _warm(prep: Callable[[], Any]) -> Timer:
    """Wall clock of ``fn`` right after an untimed ``prep`` (the same copies), so every
    copy step starts from the same cache state whatever ran before it."""
    wall = make_timer(cuda=False)

    def timer(fn: Callable[[], Any]) -> int:
        prep()
        return wall(fn)
    return timer


def measure(n: int, packages: dict[str, ModuleType], args: argparse.Namespace
            ) -> list[dict[str, Any]]:
    """Interleaved rounds at ``n`` ids; one row per step. Host-only steps (validation,
    planning) run in rounds of their own, away from the copies' cache traffic; copy
    steps run in rounds where each call follows an untimed copy of the same bytes."""
    host_fns: dict[str, Callable[[], Any]] = {}
    copy_fns: dict[str, Callable[[], Any]] = {}
    timers: dict[str, Timer] = {}
    wall = make_timer(cuda=False)
    for tag, pkg in packages.items():
        host_steps, copy_steps, copies = _steps(pkg, n, tag, current=tag == "after")
        host_fns.update(host_steps)
        copy_fns.update(copy_steps)
        timers.update(dict.fromkeys(host_steps, wall))
        if copies is not None:
            timers.update(dict.fromkeys(copy_steps, _warm(copies)))
    block_bytes = packages["after"]._presets.preset(PRESET, num_blocks=2).block_bytes
    nbytes = n * block_bytes
    iters = args.iters if nbytes <= SMALL_BYTES else max(20, args.iters * SMALL_BYTES // nbytes)
    samples = time_interleaved(host_fns, timers, warmup=args.warmup, iters=args.iters)
    if copy_fns:
        samples |= time_interleaved(copy_fns, timers, warmup=min(args.warmup, iters),
                                    iters=iters)
    medians = {name: statistics.median(s) / 1e3 for name, s in samples.items()}
    for tag in packages:
        copies_name = f"copies alone {tag}"
        for step, derived in (("load_to_device ", "overhead "),
                              ("load_to_device trusted ", "overhead trusted "),
                              ("run planned ", "dispatch ")):
            if f"{step}{tag}" in samples and copies_name in samples:
                pairs = zip(samples[f"{step}{tag}"], samples[copies_name], strict=True)
                medians[f"{derived}{tag}"] = statistics.median(a - b for a, b in pairs) / 1e3
    steps = dict.fromkeys(name.rsplit(" ", 1)[0] for name in medians)
    rows = []
    for step in steps:
        copy_step = step.startswith(("load_to_device", "copies", "overhead", "run", "dispatch"))
        row: dict[str, Any] = {"ids": n, "step": step, "bytes": nbytes,
                               "iters": iters if copy_step else args.iters}
        for tag in packages:
            row[f"{tag}_us"] = medians.get(f"{step} {tag}")
        if row.get("before_us") and row.get("after_us") is not None:
            row["ratio"] = row["after_us"] / row["before_us"]
        rows.append(row)
    return rows


def run_floor(args: argparse.Namespace) -> int:
    import kvstage

    current = ModuleType("current")
    for sub in ("blocks", "plan", "engine", "cache", "presets"):
        setattr(current, f"_{sub}", importlib.import_module(f"kvstage.{sub}"))
    packages = {"after": current}
    if args.baseline_src:
        packages = {"before": load_package(args.baseline_src), "after": current}
    rows: list[dict[str, Any]] = []
    for n in args.floor_ids:
        rows += measure(n, packages, args)
        print(f"[floor] {n} ids done", file=sys.stderr, flush=True)
    us = lambda v: f"{v:.1f}" if v < 1000 else f"{v:.0f}"  # noqa: E731
    cols = [Column("ids"), Column("step", align="<")]
    if "before" in packages:
        cols += [Column("before_us", "before us", us), Column("after_us", "after us", us),
                 Column("ratio", "after / before", "{:.2f}")]
    else:
        cols.append(Column("after_us", "us", us))
    title = (f"Per-request floor, {PRESET}, h2d, median us of interleaved rounds "
             f"(kvstage {Path(kvstage.__file__).parent})")
    print_table(rows, cols, markdown=args.markdown, title=title)
    if args.json:
        from kvstage.bench.report import machine_info

        write_json(args.json, config=vars(args), env=machine_info("cpu"), floor=rows)
        print(f"wrote {args.json}")
    return 0
