"""Host memory per model: kvstage's host buffer against vLLM's host path design.

    .venv/bin/python -m bench.host_memory --json benchmarks/host-memory.json \
        --plot benchmarks/host-memory.png
    .venv/bin/python -m bench.host_memory --replot benchmarks/host-memory.json \
        --plot benchmarks/host-memory.png

Per preset (`kvstage.presets`: vLLM's grouping and page unification applied to the
published configs) at ``--num-blocks`` blocks, from `kvstage.memory_report`: the device
pool, kvstage's host buffer (one allocation per physical tensor: the pool's bytes) and
vLLM's host path (one host buffer per layer name: layers of different KV cache groups
alias one device tensor, not one host buffer), with the groups, physical tensors and
layer names that make the difference. Exact arithmetic, no timing; the connector's host
buffer on real engines equals the device pool (tests/system/vllm). ``--plot`` draws bars per
model (log scale); ``--replot`` draws them from a saved ``--json``. Bad arguments: one line,
exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvstage import PRESETS, memory_report, preset


def measure(num_blocks: int) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(PRESETS):
        layout = preset(name, num_blocks=num_blocks)
        mem = memory_report(layout)
        rows.append({"preset": name, "num_blocks": num_blocks, "groups": layout.num_groups,
                     "tensors": layout.num_tensors, "layer_names": layout.num_layers,
                     "device_bytes": mem["device_bytes"], "kvstage_host_bytes": mem["host_bytes"],
                     "vllm_host_bytes": mem["vllm_host_bytes"],
                     "ratio": mem["vllm_host_bytes"] / mem["host_bytes"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | KV cache groups | physical tensors | layer names | device pool GiB | "
             "kvstage host GiB | vLLM host path GiB | vLLM / kvstage |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['groups']} | {r['tensors']} | {r['layer_names']} | "
                     f"{r['device_bytes'] / 2**30:.2f} | {r['kvstage_host_bytes'] / 2**30:.2f} | "
                     f"{r['vllm_host_bytes'] / 2**30:.2f} | {r['ratio']:.1f}x |")
    return "\n".join(lines)


def plot(path: str, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    names = [r["preset"] for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(12, 4.4))
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [r["kvstage_host_bytes"] / 2**30 for r in rows],
           width, label="kvstage (= the device pool)")
    ax.bar([x + width / 2 for x in xs], [r["vllm_host_bytes"] / 2**30 for r in rows], width,
           label="vLLM's host path (one buffer per layer name)")
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(f"{r['ratio']:.1f}x", (x + width / 2, r["vllm_host_bytes"] / 2**30),
                    ha="center", va="bottom", fontsize="small")
    ax.set_xticks(list(xs), [f"{n}\n{r['groups']} groups" for n, r in zip(names, rows,
                                                                        strict=True)],
                  fontsize="small")
    ax.set_yscale("log")
    ax.set_ylabel("host memory, GiB (log)")
    ax.set_title(f"host buffer for a {rows[0]['num_blocks']}-block KV pool, per model")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_memory",
                                description=__doc__.splitlines()[0])
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH.png")
    p.add_argument("--replot", default=None, metavar="PATH.json",
                   help="draw --plot from a saved --json, computing nothing")
    args = p.parse_args(argv)
    if args.num_blocks < 2:
        p.error(f"--num-blocks must be >= 2 (block 0 is the null block), got {args.num_blocks}")
    if args.plot is not None and not args.plot.endswith(".png"):
        p.error(f"--plot writes a PNG; give a path ending in .png, got {args.plot!r}")
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot PATH.png")
        try:
            rows = json.loads(Path(args.replot).read_text(encoding="utf-8"))["rows"]
        except (OSError, ValueError, KeyError) as exc:
            p.error(f"--replot {args.replot!r}: not a file this bench wrote ({exc})")
    else:
        rows = measure(args.num_blocks)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n",
                                       encoding="utf-8")
    print(table(rows))
    if args.plot:
        plot(args.plot, rows)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
