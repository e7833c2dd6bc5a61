"""`kvstage demo`: prefill -> decode over NIXL between processes on 127.0.0.1.

Spawns one prefill process per layout (gemma-3-1b: 7 KV cache groups over 4 tensors;
llama-3.1-8b: uniform), runs the requests from this process as the decode role,
verifies every byte on the decode device cache against what prefill wrote, and prints
a row per request. Exit code 1 on any mismatch or failure.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack

from kvstage.cli import args as cli_args
from kvstage.cli.decode import Row, print_rows, print_summary, run_one
from kvstage.presets import preset
from kvstage.testing.servers import PrefillProcess, make_decode

HYBRID_PROMPTS = [512, 1024, 2048, 4096, 8192]
UNIFORM_PROMPTS = [1024]
PLANS = [("gemma-3-1b", 2048, HYBRID_PROMPTS), ("llama-3.1-8b", 160, UNIFORM_PROMPTS)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--read-timeout-s", default=10.0,
                   type=cli_args.positive(float, "--read-timeout-s", high=25.0))


def run(args: argparse.Namespace) -> int:
    rows: list[Row] = []
    print("kvstage demo: prefill and decode processes on 127.0.0.1, NIXL (UCX) READ of the "
          "host buffers, every byte verified on the decode device cache\n", flush=True)
    with ExitStack() as stack:
        procs = []
        for name, blocks, _ in PLANS:
            proc = PrefillProcess(preset(name, num_blocks=blocks), transport="nixl",
                                  lease_s=30.0)
            stack.callback(proc.stop)
            procs.append(proc)
        for (name, blocks, prompts), proc in zip(PLANS, procs, strict=True):
            try:
                addr = proc.wait_ready()
            except (TimeoutError, RuntimeError) as exc:
                print(f"kvstage demo: {exc}", file=sys.stderr)
                return 1
            layout = preset(name, num_blocks=blocks)
            with make_decode(layout, transport="nixl",
                             read_timeout_s=args.read_timeout_s) as worker:
                worker.connect(*addr)
                for i, tokens in enumerate(prompts):
                    rid = f"{name.split('-')[0]}-{tokens}"
                    rows.append(run_one(worker, addr, rid, tokens, seed=100 + i,
                                        timeout_s=args.read_timeout_s))
    print_rows(rows)
    print_summary(rows)
    return 0 if rows and all(r.verified for r in rows) else 1
