"""Per-start ratios of the `bench.step_cost` runs in this folder, pooled over the starts
(`bench.ab_stats.across_starts`: geometric mean and 95 % Student-t interval), for
BENCHMARKS.md "What does the connector cost against plain vLLM?"; run from the checkout's
root:

    PYTHONPATH=. .venv/bin/python benchmarks/step-cost-starts/pool.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.ab_stats import across_starts
from bench.step_cost import with_ratios

HERE = Path(__file__).parent
SHOWN = (("ttft", "mean"), ("ttft", "p10"), ("itl", "mean"), ("itl", "p10"))


def starts(name: str, arrangement: str) -> list[list[dict[str, Any]]]:
    results = json.loads((HERE / f"{name}.json").read_text())["results"][arrangement]
    return [with_ratios(rows) for rows in results]


def x(rows: list[dict[str, Any]], server: str, k: str, stat: str) -> float:
    return float(next(r for r in rows if r["server"] == server)[f"{k}_stats_x"][stat][0])


def show(title: str, values: dict[tuple[str, str], list[float]]) -> None:
    print(title)
    for (k, stat), v in values.items():
        print(f"  {k} {stat}: {across_starts(v)}")


def main() -> None:
    runs = {"aab": starts("aab", "aab")}
    for path in sorted(HERE.glob("null*.json")):  # null, null-pause, null-poll-10s
        runs[path.stem] = starts(path.stem, "null")
    kv, null, aa = "2-kvstage-consumer", "1-null-connector", "1-plain"
    for run in runs:
        if run.startswith("null"):
            show(f"kvstage / null connector, per start ({run}, {len(runs[run])} starts):",
                 {(k, s): [x(t, kv, k, s) / x(t, null, k, s) for t in runs[run]]
                  for k, s in SHOWN})
    both = runs["aab"] + runs["null"]
    show(f"kvstage / plain (aab and null, {len(both)} starts):",
         {(k, s): [x(t, kv, k, s) for t in both] for k, s in SHOWN})
    show("kvstage / the A/A's second plain (aab):",
         {(k, s): [x(t, kv, k, s) / x(t, aa, k, s) for t in runs["aab"]] for k, s in SHOWN})
    lean_runs(runs)


def lean_runs(runs: dict[str, list[list[dict[str, Any]]]]) -> None:
    """BENCHMARKS "Idle connector steps": the runs of `bench.lean_vllm`'s change."""
    null, lean, kv, kv_lean = "1-null-connector", "2-null-lean", "1-kvstage-consumer", \
        "2-kvstage-lean"
    if not (HERE / "lean.json").exists():
        return
    runs["lean"] = starts("lean", "lean")
    show("null connector with idle steps / without, per start (lean, 10 starts):",
         {(k, s): [x(t, lean, k, s) / x(t, null, k, s) for t in runs["lean"]]
          for k, s in SHOWN})
    every_null = [t for name, r in runs.items() if name.startswith(("null", "lean")) for t in r]
    show(f"null connector / plain (every run with one, {len(every_null)} starts):",
         {(k, s): [x(t, null, k, s) for t in every_null] for k, s in SHOWN})
    if (HERE / "lean-kvstage.json").exists():
        both = starts("lean-kvstage", "lean-kvstage")
        show("kvstage with idle steps / without, per start (lean-kvstage, 10 starts):",
             {(k, s): [x(t, kv_lean, k, s) / x(t, kv, k, s) for t in both] for k, s in SHOWN})
        # kvstage as it runs by default since the pause cut (61e8bb5): null-pause's and
        # lean-kvstage's unchanged consumer
        show("kvstage / plain since the pause cut (null-pause and lean-kvstage, 20 starts):",
             {(k, s): [x(t, "2-kvstage-consumer", k, s) for t in runs["null-pause"]]
              + [x(t, kv, k, s) for t in both] for k, s in SHOWN})


if __name__ == "__main__":
    main()
