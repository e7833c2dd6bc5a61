"""`kvstage bench copy`: device <-> host copy strategies, timed, op-counted, memory-checked.

Reproduces vLLM PR #54483's tables (per_group = before, coalesced = after) and adds
kvstage's fused strategy plus a plain ``copy_`` of fused's bytes (this machine's copy
bandwidth). Strategies run interleaved, in a fresh random order every round, so a
noisy, shared machine slows all of them alike; min and median are reported. CUDA is
only touched with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstage.bench.copy_bench import Bench
from kvstage.bench.copy_cases import build_cases, case_sizes
from kvstage.bench.copy_counts import (
    count_ops,
    measure_memory,
    plot_op_counts,
    print_count_tables,
)
from kvstage.bench.floor import DEFAULT_IDS as DEFAULT_FLOOR_IDS
from kvstage.bench.floor import run_floor
from kvstage.bench.report import (
    Column,
    Progress,
    format_bytes,
    machine_info,
    make_timer,
    pivot,
    plot_lines,
    print_table,
    ratio,
    summarize_ns,
    time_interleaved,
    write_json,
)
from kvstage.cache import HostLayout
from kvstage.cli import memory
from kvstage.cli.args import number
from kvstage.engine import Direction
from kvstage.layout import cdiv
from kvstage.plan import DEFAULT_MAX_TEMP_BYTES, plan_copy
from kvstage.presets import PRESETS, preset

STRATEGIES = ("per_group", "coalesced", "fused")
DEFAULT_GROUPS = [1, 2, 3, 6]
DEFAULT_PROMPTS = [512, 2048, 8192]
MAX_LAYERS = 4096
MAX_FLOOR_IDS = 1 << 20  # the floor builds Python lists of the ids: bounded here


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_upto(high: int) -> Callable[[str], int]:
    """`_positive_int` with a ceiling (sizes that are not bytes, so the memory check does
    not bound them: layers, iterations, threads)."""

    def parse(text: str) -> int:
        value = _positive_int(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--num-layers", type=_positive_upto(MAX_LAYERS), nargs="+", default=None, help="default 16")
    a("--blocks-per-request", type=_positive_int, default=6, help="default 6 (PR regime)")
    a("--groups", type=_positive_upto(MAX_LAYERS), nargs="+", default=None, help="default 1 2 3 6")
    a("--direction", choices=("h2d", "d2h", "both"), default="both")
    a("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    a("--ids", choices=("contiguous", "scattered"), default="contiguous",
      help="contiguous: 1..B split into G consecutive groups; scattered: from a churned pool")
    a("--preset", choices=sorted(PRESETS), default=None, help="a model layout, not synthetic")
    a("--prompt-tokens", type=_positive_int, nargs="+", default=None,
      help=f"prompt lengths for --preset (default {' '.join(map(str, DEFAULT_PROMPTS))})")
    a("--host-layout", nargs="+", choices=[h.value for h in HostLayout],
      default=[HostLayout.BLOCK_MAJOR.value], help="several: fused runs once per layout")
    a("--fused-mode", choices=("auto", "direct", "staged"), default="auto")
    a("--max-temp-bytes", type=_positive_int, default=DEFAULT_MAX_TEMP_BYTES)
    a("--num-blocks", type=_positive_int, default=None, help="pool size (default: auto)")
    a("--iters", type=_positive_upto(10**6), default=None, help="timed iterations (default 200)")
    a("--warmup", type=number(int, "--warmup", inclusive=True, high=10**6), default=None,
      help="untimed iterations first (default 20)")
    a("--op-counts", action="store_true", help="device ops per request: profiler + OpCounter")
    a("--memory", action="store_true", help="peak temporary bytes per strategy")
    a("--no-timing", action="store_true", help="only op counts / memory")
    a("--device", choices=("cpu", "cuda"), default="cpu")
    a("--json", default=None, metavar="PATH")
    a("--plot", default=None, metavar="PATH.png",
      help="latency against group count; with --op-counts --no-timing: ops per request")
    a("--replot", default=None, metavar="PATH.json",
      help="draw --plot from a --json file this bench wrote, measuring nothing")
    a("--markdown", action="store_true", help="print tables as GitHub markdown")
    a("--quick", action="store_true", help="a few seconds: CI smoke and demo")
    a("--seed", type=number(int, "--seed", inclusive=True), default=0)
    a("--threads", type=_positive_upto(1024), default=None,
      help="torch intra-op threads (default: torch's; 1 with --quick); 1 is steadier "
      "on a shared machine")
    a("--floor", action="store_true",
      help="per-request CPU floor instead: validate, plan, copy steps (bench/floor.py)")
    a("--floor-ids", type=_positive_upto(MAX_FLOOR_IDS), nargs="+", default=None,
      help=f"ids per request for --floor (default {' '.join(map(str, DEFAULT_FLOOR_IDS))})")
    a("--baseline-src", default=None, metavar="DIR",
      help="with --floor: also time the kvstage package under DIR (an older checkout)")
    parser.set_defaults(_parser=parser)


def _resolve(args: argparse.Namespace) -> None:
    """Fill defaults that depend on other flags; reject combinations with argparse errors."""
    err = args._parser.error
    if args.preset:
        if args.groups or args.num_layers:
            err("--groups/--num-layers do not apply with --preset: the model fixes them")
        args.prompt_tokens = args.prompt_tokens or DEFAULT_PROMPTS
        probe = preset(args.preset, num_blocks=2)
        need = probe.num_groups * cdiv(max(args.prompt_tokens), probe.block_size) + 1
        if args.num_blocks is not None and args.num_blocks < need:
            err(f"--num-blocks {args.num_blocks} cannot hold a {max(args.prompt_tokens)}-token "
                f"prompt of {args.preset}: every group allocates before SW clipping; "
                f"pass >= {need} or leave it out")
    else:
        if args.prompt_tokens:
            err("--prompt-tokens needs --preset (synthetic requests use --blocks-per-request)")
        args.groups = args.groups or DEFAULT_GROUPS
        args.num_layers = args.num_layers or [16]
        for g in args.groups:
            if g > args.blocks_per_request:
                err(f"--groups {g} exceeds --blocks-per-request {args.blocks_per_request}: "
                    "every group needs at least one block; raise --blocks-per-request")
            for n in args.num_layers:
                if g > n:
                    err(f"--groups {g} exceeds --num-layers {n}: a group needs >= 1 layer")
    args.iters = args.iters or (10 if args.quick else 200)
    args.warmup = (2 if args.quick else 20) if args.warmup is None else args.warmup
    if args.plot and not args.plot.endswith(".png"):
        err(f"--plot writes a PNG; give a path ending in .png, got {args.plot!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        err("--device cuda but torch.cuda.is_available() is False (CPU-only torch or no GPU)")
    b = args.blocks_per_request
    if args.num_blocks is not None and not args.preset and args.num_blocks <= b:
        err(f"--num-blocks {args.num_blocks} must exceed --blocks-per-request "
            f"{args.blocks_per_request} (block 0 is the null block)")
    try:
        _check_memory(args)
    except argparse.ArgumentTypeError as exc:
        err(str(exc))


def _check_memory(args: argparse.Namespace) -> None:
    """Refuse (ArgumentTypeError) a run whose largest case would not fit in free memory,
    before any case is built. A case holds its device pool and the memcpy reference on
    the device, and per host layout a host buffer, plus the memcpy reference, verify's
    two copies of the request and a staged chunk on the host."""
    hosts = len(set(args.host_layout))
    need = []
    for layout, blocks in case_sizes(args):
        req = blocks * layout.block_bytes
        device = layout.pool_bytes + req
        host = hosts * layout.pool_bytes + 3 * req + min(args.max_temp_bytes, req)
        need.append((host + (device if args.device == "cpu" else 0), host, device, layout))
    _total, host, device, layout = max(need, key=lambda n: n[0])
    if args.preset:
        what = (f"--prompt-tokens {max(args.prompt_tokens)} ({args.preset}, a "
                f"{layout.num_blocks}-block pool)")
        fix = "lower --prompt-tokens (or --num-blocks)"
    else:
        what = (f"--blocks-per-request {args.blocks_per_request} (a {layout.num_blocks}-block "
                f"pool of {layout.num_layers} layers)")
        fix = "lower --blocks-per-request, --num-layers or --num-blocks"
    memory.check_fits(what, host, fix, device=args.device, device_bytes=device)


def time_case(bench: Bench, direction: Direction, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Interleaved timings of every variant, the memcpy row and fused's planning alone."""
    layout, ids, plan = bench.case.layout, bench.ids, bench.plan
    fns = {name: bench.request(name, direction) for name in bench.variants}
    fns["memcpy"] = bench.memcpy(direction)
    fns["fused plan"] = lambda: plan_copy(layout, ids, max_temp_bytes=args.max_temp_bytes)
    if any(name.startswith("fused") for name in bench.variants):
        fns["fused copies"] = bench.copies(direction)
    verified = {name: bench.verify(name, direction) for name in bench.variants}
    nbytes = {name: bench.variants[name][0].copy(ids, direction).nbytes for name in bench.variants}
    nbytes["memcpy"] = nbytes["fused copies"] = plan.nbytes
    timers = dict.fromkeys(fns, make_timer(cuda=bench.cuda))
    timers["fused plan"] = make_timer(cuda=False)  # host-only numpy work: wall clock
    samples = time_interleaved(fns, timers, warmup=args.warmup, iters=args.iters)
    rows = []
    for name, fn_samples in samples.items():
        stats = summarize_ns(fn_samples)
        moved = nbytes.get(name)
        host = bench.variants[name][1] if name in bench.variants else None
        rows.append({
            "case": bench.case.label, **bench.case.meta, "ids": args.ids,
            "direction": direction.value, "strategy": name,
            "host_layout": host.value if host else None, "blocks": plan.num_blocks,
            "runs": plan.num_runs, "nbytes": moved, "min_bytes": plan.nbytes,
            "descriptors": plan.num_descriptors(host is HostLayout.BLOCK_MAJOR)
            if name.startswith("fused[") or name == "fused" else None,
            **stats, "gbps": moved / stats["median_us"] / 1e3 if moved else None,
            "verified": verified.get(name),
        })
    return rows


def run(args: argparse.Namespace) -> int:
    if args.floor or args.floor_ids or args.baseline_src:
        if not args.floor:
            args._parser.error("--floor-ids/--baseline-src need --floor")
        args.floor_ids = args.floor_ids or DEFAULT_FLOOR_IDS
        args.iters = args.iters or (20 if args.quick else 2000)
        args.warmup = (2 if args.quick else 200) if args.warmup is None else args.warmup
        torch.set_num_threads(args.threads or 1)
        return run_floor(args)
    if args.replot:
        return _replot(args)
    _resolve(args)
    # --quick pins one thread: with the cores oversubscribed, torch's OpenMP barriers can
    # stall a single op for milliseconds (BENCHMARKS.md: every CPU table uses --threads 1)
    threads = args.threads or (1 if args.quick else None)
    if threads:
        torch.set_num_threads(threads)
    cases = build_cases(args)
    directions = [Direction.D2H, Direction.H2D] if args.direction == "both" else [
        Direction(args.direction)]
    progress = Progress(len(cases) * len(directions))
    timings: list[dict[str, Any]] = []
    ops: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    for case in cases:
        bench = Bench(case, args)
        for direction in directions:
            if not args.no_timing:
                timings += time_case(bench, direction, args)
            if args.op_counts:
                ops += count_ops(bench, direction)
            if args.memory:
                memory += measure_memory(bench, direction, args)
            progress.step(f"{case.label} {direction.value}")
        del bench
    print_tables(args, timings, ops, memory)
    if args.json:
        env = machine_info(args.device)
        write_json(args.json, config=vars(args), env=env, timings=timings, op_counts=ops,
                   memory=memory)
        print(f"wrote {args.json}")
    if args.plot and timings:
        _plot(args, timings)
        print(f"wrote {args.plot}")
    elif args.plot and ops:
        plot_op_counts(args.plot, ops)
        print(f"wrote {args.plot}")
    bad = [r for r in timings if r["verified"] is False]
    bad += [r for r in ops if r["matches_expected"] is False or r["agree"] is False]
    return 1 if bad else 0


def _replot(args: argparse.Namespace) -> int:
    """``--replot JSON --plot PNG``: the figure of a saved run (its config decides which)."""
    if not args.plot or not args.plot.endswith(".png"):
        args._parser.error("--replot needs --plot PATH.png")
    try:
        saved = json.loads(Path(args.replot).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        args._parser.error(f"--replot {args.replot!r}: not a readable JSON file ({exc})")
    config = saved.get("config", {})
    if saved.get("timings"):
        for key in ("preset", "device", "ids"):
            setattr(args, key, config.get(key, getattr(args, key)))
        _plot(args, saved["timings"])
    elif saved.get("op_counts"):
        plot_op_counts(args.plot, saved["op_counts"])
    else:
        args._parser.error(f"--replot {args.replot!r} has neither timings nor op counts")
    print(f"wrote {args.plot}")
    return 0


def _plot(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    xkey = "prompt_tokens" if args.preset else "groups"
    panels: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    series: dict[tuple[str, str], Counter[float]] = {}
    for r in rows:
        if r["strategy"] in ("fused plan", "fused copies"):
            continue
        label = r["strategy"] if args.preset else f"{r['strategy']} {r['num_layers']}L"
        series.setdefault((r["direction"], label), Counter())[r[xkey]] = r["median_us"]
    for (direction, label), points in series.items():
        xs = sorted(points)
        panels.setdefault(direction, {})[label] = (xs, [points[x] for x in xs])
    plot_lines(args.plot, panels, xlabel=xkey.replace("_", " "), ylabel="median latency (us)",
               title=f"kvstage bench copy ({args.device}, {args.ids} ids)", logy=True)


# -- tables ---------------------------------------------------------------------------
def _us(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def print_tables(args: argparse.Namespace, timings: list[dict[str, Any]],
                 ops: list[dict[str, Any]], memory: list[dict[str, Any]]) -> None:
    md = args.markdown
    case = Column("case", "case", align="<")
    fused = next((r["strategy"] for r in timings if r["strategy"].startswith("fused")), "fused")
    if timings:
        summary = pivot(timings, ("case", "direction"), "strategy", lambda r: r["median_us"])
        for r in summary:
            r["saved"] = ratio(r.get("per_group", 0) - r.get("coalesced", 0), r.get("per_group"))
            r["x_fused"] = ratio(r.get("coalesced"), r.get(fused))
            r["bw"] = ratio(r.get("memcpy"), r.get(fused))
            # planning is numpy on the host; a caller can overlap it (estimate: medians)
            exec_us = r[fused] - r["fused plan"] if fused in r and "fused plan" in r else None
            r["x_exec"] = ratio(r.get("coalesced"), exec_us)
            # validation + planning + dispatch: what fused costs beyond its copy_ calls
            if fused in r and "fused copies" in r:
                r["overhead"] = r[fused] - r["fused copies"]
        present = list(dict.fromkeys(r["strategy"] for r in timings))
        cols = [case, Column("direction", "dir", align="<")]
        cols += [Column(s, f"{s} us", _us) for s in present]
        if "per_group" in present and "coalesced" in present:
            cols.append(Column("saved", "PR saved", "{:.1%}"))
        if "coalesced" in present:
            cols += [Column("x_fused", "fused vs coalesced", "{:.1f}x"),
                     Column("x_exec", "excl. plan", "{:.1f}x")]
        cols.append(Column("bw", "fused % memcpy BW", "{:.0%}"))
        if "fused copies" in present:
            cols.append(Column("overhead", "overhead us", _us))
        note = f"; fused = {fused}" if fused != "fused" else ""
        title = f"Latency per request, median of {args.iters} ({args.device}, {args.ids} ids{note})"
        print_table(summary, cols, markdown=md, title=title)
        detail = [Column("strategy", align="<"), Column("blocks"), Column("runs"),
                  Column("descriptors", "descs"), Column("nbytes", "moved", format_bytes),
                  Column("min_bytes", "min bytes", format_bytes), Column("min_us", "min us", _us),
                  Column("median_us", "median us", _us), Column("gbps", "GB/s", "{:.2f}"),
                  Column("verified", "ok")]
        print_table(timings, [case, Column("direction", "dir", align="<"), *detail], markdown=md,
                    title="All timings (GB/s = bytes moved / median)")
    print_count_tables(args, ops, memory)
