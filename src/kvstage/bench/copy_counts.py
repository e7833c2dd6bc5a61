"""Op counts and peak temporary memory of one request per strategy (`kvstage bench copy
--op-counts --memory`): the expected counts, torch.profiler and kvstage's OpCounter side
by side, and the staged path's memory bound."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstage.bench.copy_bench import Bench, make_variant
from kvstage.bench.report import (
    Column,
    cuda_peak_bytes,
    format_bytes,
    pivot,
    plot_lines,
    print_table,
    profiler_counts,
)
from kvstage.cache import HostLayout
from kvstage.engine import CopyEngine, Direction
from kvstage.testing.baselines import BaselineEngine
from kvstage.testing.opcount import OpCounter

if TYPE_CHECKING:
    import argparse

# the ops both counters must agree on (profiler outermost aten ops vs OpCounter)
COMPARED_OPS = ("copy_", "index", "index_put_", "index_select", "index_copy_")


# -- op counts and memory -------------------------------------------------------------
def _expected_ops(
    bench: Bench, engine: CopyEngine | BaselineEngine, direction: Direction
) -> dict[str, int]:
    """Exact device ops per request: per_group G x L x k, coalesced L x k, fused one op
    set per run (direct) or per chunk plus one DMA per run piece (staged); k = 2
    (index, index_put_) as counted here (CUDA's .to() copy is a separate _to_copy)."""
    layout, plan = bench.case.layout, bench.plan
    out = dict.fromkeys(COMPARED_OPS, 0)
    strategy = engine.strategy.value if isinstance(engine, BaselineEngine) else "fused"
    if not isinstance(engine, CopyEngine):
        calls = sum(1 for g in bench.case.groups if g) if strategy == "per_group" else 1
        out["index"] = out["index_put_"] = calls * layout.num_layers
    elif engine.mode == "direct":
        out["copy_"] = plan.num_runs
    else:
        per_piece = 1 if engine.host.block_major or not bench.cuda else (
            layout.num_tensors * layout.num_planes)
        out["copy_"] = int(plan.pieces.shape[0]) * per_piece
        out["index_select" if direction is Direction.D2H else "index_copy_"] = plan.num_chunks
    return out


def count_ops(bench: Bench, direction: Direction) -> list[dict[str, Any]]:
    """One request per variant under OpCounter and one under torch.profiler."""
    rows = []
    for name, (engine, _host) in bench.variants.items():
        fn = bench.request(name, direction)
        fn()  # warm: lazy initialisation stays out of the counts
        bench.sync()
        with OpCounter() as counter:
            fn()
            bench.sync()
        prof = profiler_counts(fn, cuda=bench.cuda)
        expected = _expected_ops(bench, engine, direction)
        device_ops = sorted(k for k in prof if k.startswith(("Memcpy", "Memset", "CUDA")))
        for op in [*COMPARED_OPS, "lift_fresh", "_to_copy", "data ops", *device_ops]:
            if op in device_ops:
                p, o = prof[op], None
            elif op == "data ops":  # every byte-moving op the OpCounter saw
                p, o = None, counter.data_ops
            else:
                p, o = prof.get(op, 0), counter.counts.get(op, 0)
            exp = expected.get(op)
            rows.append({
                "case": bench.case.label, **bench.case.meta, "direction": direction.value,
                "strategy": name, "op": op, "profiler": p, "opcounter": o, "expected": exp,
                "agree": (p == o) if op in COMPARED_OPS else None,
                "matches_expected": None if exp is None else (p == exp and o == exp),
            })
    return rows


def measure_memory(bench: Bench, direction: Direction, args: argparse.Namespace
                   ) -> list[dict[str, Any]]:
    """Peak temporary bytes of one request: the baselines, fused staged and fused direct."""
    layout = bench.case.layout
    host = bench.hosts[HostLayout(args.host_layout[0])]
    variants = [(s, "auto") for s in ("per_group", "coalesced") if s in args.strategies]
    variants += [("fused", "staged"), ("fused", "direct")]
    bound = args.max_temp_bytes + layout.block_bytes  # a chunk always holds >= 1 block
    rows = []
    for strategy, mode in variants:
        engine = make_variant(bench.cache, host, strategy, args.max_temp_bytes, mode)
        fn = lambda e=engine: e.copy(bench.ids, direction)  # noqa: E731
        fn()
        bench.sync()
        with OpCounter() as counter:
            fn()
            bench.sync()
        staged = mode == "staged"
        rows.append({
            "case": bench.case.label, **bench.case.meta, "direction": direction.value,
            "strategy": f"fused {mode}" if strategy == "fused" else strategy,
            "peak_temp_bytes": counter.peak_temp_bytes,
            "cuda_peak_bytes": cuda_peak_bytes(fn) if bench.cuda else None,
            "request_bytes": bench.plan.nbytes,
            "budget": args.max_temp_bytes if staged else None,
            "bounded": counter.peak_temp_bytes <= bound if staged else None,
        })
    return rows


def print_count_tables(args: argparse.Namespace, ops: list[dict[str, Any]],
                       memory: list[dict[str, Any]]) -> None:
    """The op-count table and the peak-memory tables (CUDA's allocator too on CUDA)."""
    md = args.markdown
    case = Column("case", "case", align="<")
    if ops:
        shown = {r["op"] for r in ops if r["profiler"] or r["opcounter"] or r["expected"]}
        wide = pivot([r for r in ops if r["op"] in shown], ("groups", "direction", "op"),
                       "strategy", lambda r: "/".join("-" if v is None else str(v) for v in (
                           r["profiler"], r["opcounter"])))
        for p in wide:
            flags = [r for r in ops if (r["groups"], r["direction"], r["op"]) == (
                p["groups"], p["direction"], p["op"])]
            agree = [r["agree"] for r in flags if r["agree"] is not None]
            exp = [r["matches_expected"] for r in flags if r["matches_expected"] is not None]
            p["agree"] = ("yes" if all(agree) else "NO") if agree else "n/a"
            p["expected"] = ("yes" if all(exp) else "NO") if exp else "n/a"
        names = list(dict.fromkeys(r["strategy"] for r in ops))
        cols = [Column("groups"), Column("direction", "dir", align="<"),
                Column("op", "operation", align="<"), *(Column(n) for n in names),
                Column("agree", "profiler = OpCounter"), Column("expected", "= expected")]
        print_table(wide, cols, markdown=md,
                    title="Device ops per request (torch.profiler / kvstage OpCounter)")
    if memory:
        wide = pivot(memory, ("case", "direction", "blocks_per_group", "request_bytes"),
                       "strategy", lambda r: r["peak_temp_bytes"])
        for p in wide:
            p["bounded"] = all(r["bounded"] for r in memory if r["bounded"] is not None and (
                r["case"], r["direction"]) == (p["case"], p["direction"]))
        strategies = list(dict.fromkeys(r["strategy"] for r in memory))
        cols = [case, Column("direction", "dir", align="<"),
                Column("blocks_per_group", "blocks per group", align="<"),
                Column("request_bytes", "request", format_bytes),
                *(Column(s, fmt=format_bytes) for s in strategies),
                Column("bounded", f"staged <= {format_bytes(args.max_temp_bytes)} + 1 block")]
        print_table(wide, cols, markdown=md, title="Peak temporary bytes per request (OpCounter)")
        if args.device == "cuda":
            cuda_cols = [case, Column("direction", "dir", align="<"),
                         *(Column(s, fmt=format_bytes) for s in strategies)]
            print_table(pivot(memory, ("case", "direction"), "strategy",
                               lambda r: r["cuda_peak_bytes"]), cuda_cols, markdown=md,
                        title="Peak CUDA allocator bytes per request (max_memory_allocated)")


def plot_op_counts(path: str, rows: list[dict[str, Any]], *, title: str = "") -> None:
    """Data ops per request (OpCounter: copies and index ops) against the number of KV
    cache groups, one line per strategy, one panel per layer count; d2h (h2d is the same).
    ``rows``: `count_ops`' rows, as ``kvstage bench copy --op-counts --json`` saves them."""
    panels: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    points: dict[tuple[int, str], dict[int, int]] = {}
    for r in rows:
        if r["op"] == "data ops" and r["direction"] == "d2h":
            points.setdefault((r["num_layers"], r["strategy"]), {})[r["groups"]] = r["opcounter"]
    names = {"per_group": "vLLM before PR #54483 (per group, per layer)",
             "coalesced": "vLLM after PR #54483 (per layer)", "fused": "kvstage (fused)"}
    for (layers, strategy), by_groups in sorted(points.items()):
        xs = sorted(by_groups)
        panels.setdefault(f"{layers} layers", {})[names.get(strategy, strategy)] = (
            [float(x) for x in xs], [float(by_groups[x]) for x in xs])
    plot_lines(path, panels, xlabel="KV cache groups", ylabel="device ops per request",
               title=title or "copy ops per request (contiguous ids, d2h)", logy=True)
