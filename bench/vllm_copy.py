"""kvstage's copy_blocks vs vLLM's copy_kv_blocks on vLLM's own buffers, in one process.

Device caches as vLLM 0.32.0 allocates them (4-D ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` bf16 views of one int8 backing buffer, layers of different groups
aliasing a tensor), host buffers as vLLM's ``initialize_host_xfer_buffer`` makes them (one
per layer name). Both ops get the same ids (the request's groups concatenated, as
``save_kv_to_host`` passes them) and run interleaved, ``torch.set_num_threads(1)``; the
table shows medians. The baseline is vLLM's real op (the CPU platform given the CUDA
platform's two bodies from vLLM's cuda.py) when vLLM is importable, else the transcribed
loop from tests/integrations/test_vllm_copy_op.py.

    .venv-vllm/bin/python -m bench.vllm_copy [--repeats 21]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import statistics
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from kvstage.integrations.vllm import copy_blocks

Caches = dict[str, torch.Tensor]


def vllm_loop(src: Caches, dst: Caches, src_ids: list[int], dst_ids: list[int], _: str) -> None:
    s_idx = torch.tensor(src_ids, device=next(iter(src.values())).device, dtype=torch.int64)
    d_idx = torch.tensor(dst_ids, device=next(iter(dst.values())).device, dtype=torch.int64)
    for name in src:
        dst[name][d_idx] = src[name][s_idx].to(dst[name].device)


def real_vllm_op() -> Callable[..., None] | None:
    """vLLM's copy_kv_blocks with the CUDA bodies installed on the CPU platform."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.platforms.cpu import CpuPlatform

    spec = importlib.util.find_spec("vllm.platforms.cuda")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    lines = source.splitlines()
    ns: dict[str, Any] = {"torch": torch}
    for c in ast.parse(source).body:
        if not (isinstance(c, ast.ClassDef) and c.name.startswith("CudaPlatform")):
            continue
        for fn in c.body:
            if isinstance(fn, ast.FunctionDef) and fn.name in (
                "insert_blocks_to_device",
                "swap_out_blocks_to_host",
            ):
                first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
                body = textwrap.dedent("\n".join(lines[first - 1 : fn.end_lineno]))
                exec(compile("class C:\n" + textwrap.indent(body, "    "), spec.origin, "exec"), ns)
                setattr(CpuPlatform, fn.name, ns["C"].__dict__[fn.name])
    return cast(Callable[..., None], utils.copy_kv_blocks)


def caches(
    tensor_of: list[int], num_blocks: int, heads: int, block_size: int, head_size: int
) -> tuple[Caches, Caches]:
    """(device, host): aliased views of one backing buffer, one host tensor per name."""
    num_t = max(tensor_of) + 1
    shape = (num_blocks, heads, block_size, 2 * head_size)
    per = num_blocks * heads * block_size * 2 * head_size
    backing = torch.randint(-128, 128, (num_t * per * 2,), dtype=torch.int8)
    elems = backing.view(torch.bfloat16)
    tensors = [elems[t * per : (t + 1) * per].view(shape) for t in range(num_t)]
    device = {f"model.layers.{i}.self_attn.attn": tensors[t] for i, t in enumerate(tensor_of)}
    host = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in device}
    return device, host


def gemma_tensor_of() -> list[int]:
    full = [i for i in range(26) if i % 6 == 5]
    sliding = [i for i in range(26) if i % 6 != 5]
    groups = [full] + [sliding[k : k + 4] for k in range(0, len(sliding), 4)]
    pos = {layer: j for g in groups for j, layer in enumerate(g)}
    return [pos[i] for i in range(26)]


def gemma_ids(tokens: int, block_size: int = 16, window: int = 512) -> list[int]:
    """The 7 groups' ids concatenated: full attention all blocks, sliding window the
    window's blocks (+1), each group contiguous in a fresh pool starting at block 1."""
    full = -(-tokens // block_size)
    sliding = min(full, window // block_size + 1)
    ids: list[int] = []
    nxt = 1
    for n in [full] + [sliding] * 6:
        ids += range(nxt, nxt + n)
        nxt += n
    return ids


def timed(
    fn: Callable[..., None],
    times: list[float],
    src: Caches,
    dst: Caches,
    ids: list[int],
    direction: str,
) -> None:
    t0 = time.perf_counter()
    fn(src, dst, ids, ids, direction)
    times.append((time.perf_counter() - t0) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    real = real_vllm_op()
    baseline = real or vllm_loop
    name = "vLLM copy_kv_blocks (real)" if real else "vLLM loop (transcribed)"
    ids_2k = list(range(1, 129))
    cases: list[tuple[str, list[int], int, int, int, list[int]]] = [
        ("16 layers, 16 tensors", list(range(16)), 8, 16, 128, ids_2k),
        ("16 layers, 3 tensors", [i % 3 for i in range(16)], 8, 16, 128, ids_2k),
    ] + [
        (f"gemma-3-1b {t} tok", gemma_tensor_of(), 1, 16, 256, gemma_ids(t))
        for t in (512, 2048, 8192)
    ]
    print(f"baseline: {name}; torch {torch.__version__}, 1 thread, median of {args.repeats}")
    print(f"| case | ids | dir | MiB moved (vLLM) | {name} ms | kvstage ms | speed-up |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for label, tensor_of, heads, bs, hs, ids in cases:
        dev, host = caches(tensor_of, max(ids) + 1, heads, bs, hs)
        for direction in ("d2h", "h2d"):
            src, dst = (dev, host) if direction == "d2h" else (host, dev)
            theirs: list[float] = []
            ours: list[float] = []
            for _ in range(2):  # warm-up
                baseline(src, dst, ids, ids, direction)
                copy_blocks(src, dst, ids, ids, direction)
            for _ in range(args.repeats):  # interleaved
                timed(baseline, theirs, src, dst, ids, direction)
                timed(copy_blocks, ours, src, dst, ids, direction)
            page = next(iter(dev.values()))[0].nbytes
            moved = len(tensor_of) * len(ids) * page / 2**20
            a, b = statistics.median(theirs), statistics.median(ours)
            print(
                f"| {label} | {len(ids)} | {direction} | {moved:.1f} | {a:.3f} | {b:.3f} "
                f"| {a / b:.1f}x |"
            )


if __name__ == "__main__":
    main()
