"""Print, for the state-hybrid presets, what one request of N prompt tokens moves and what the
host buffer costs: kvstage's layout against vLLM's host path design (one host buffer per
layer name). Exact arithmetic from `kvstage.presets` (no timing). READ descriptors: vLLM's
NIXL read path (which KVStageConnector keeps) posts one per (attention layer, block) and
one per (state layer region: 3 conv sub-projections + the SSM state for Mamba2 / GDN);
kvstage's own roles, block-major host buffer, one per run of blocks (at most one per block
of every group, whatever the layers):

    .venv/bin/python scripts/ssm_presets_table.py [--tokens 8192] [--num-blocks 1024]
"""

from __future__ import annotations

import argparse

from kvstage.blocks import request_blocks
from kvstage.cache import memory_report
from kvstage.layout import MambaSpec
from kvstage.presets import STATE_PRESETS, preset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=1024)
    a = p.parse_args()
    print("| preset | groups (state) | tensors | layers | attention block | page B | blocks "
          "per request | bytes per request | host buffer (kvstage) | per-layer-name host "
          "buffers (vLLM) | READ descriptors (vLLM's path) | (kvstage roles, at most) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in STATE_PRESETS:
        lay = preset(name, num_blocks=a.num_blocks)
        blocks = sum(request_blocks(lay, a.tokens))
        states = sum(isinstance(g.spec, MambaSpec) for g in lay.groups)
        mem = memory_report(lay)
        per_group = request_blocks(lay, a.tokens)
        descs = sum(
            len(g.layer_names) * (4 * n if isinstance(g.spec, MambaSpec) else n)
            for g, n in zip(lay.groups, per_group, strict=True)
        )
        print(f"| {name} | {lay.num_groups} ({states}) | {lay.num_tensors} | {lay.num_layers} "
              f"| {lay.block_size} | {lay.page_size_bytes} | {blocks} "
              f"| {blocks * lay.block_bytes / 2**20:.1f} MiB | {mem['host_bytes'] / 2**30:.2f} GiB "
              f"| {mem['vllm_host_bytes'] / 2**30:.2f} GiB | {descs} | {blocks} |")


if __name__ == "__main__":
    main()
