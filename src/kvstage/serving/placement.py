"""Where a P/D deployment's instances run: cores per instance and rank on CPU, GPUs per
instance on CUDA.

Contract (pure, no process is started; `cluster` and `roles` apply the result):
- `split_cores`: cores per instance at TP 1 (a chunk each, or prefills and decodes split).
- `place_ranks`: cores per instance and rank; where the ranks outnumber the cores each
  instance gets all of them and its ranks are left to the kernel (`omp_threads_bind`:
  ``VLLM_CPU_OMP_THREADS_BIND`` is then `UNBOUND`).
- `visible_gpus`, `gpu_assignment`: GPUs per instance, one per rank, refused in one line
  when too few are visible unless shared.
"""

from __future__ import annotations

import os
import re

from kvstage.serving.instances import ServingError


def split_cores(cores: list[int], num_prefill: int, num_decode: int) -> list[tuple[int, ...]]:
    """Cores per instance, prefills first: a chunk each when there are enough cores, else
    prefills share the first half and decodes the rest (all share one core if only one)."""
    n = num_prefill + num_decode
    if len(cores) >= n:
        per = len(cores) // n
        return [tuple(cores[i * per:(i + 1) * per]) for i in range(n)]
    if len(cores) == 1:
        return [tuple(cores)] * n
    half = max(1, len(cores) * num_prefill // n)
    return [tuple(cores[:half])] * num_prefill + [tuple(cores[half:])] * num_decode


def place_ranks(cores: list[int], num_prefill: int, num_decode: int, prefill_tp: int = 1,
                decode_tp: int = 1) -> list[tuple[tuple[int, ...], ...]]:
    """Cores per instance and tensor-parallel rank, prefills first. At TP 1 everywhere,
    `split_cores`. Else, with a core per rank or more: consecutive chunks (each rank
    ``len(cores) // ranks`` cores); with fewer, every instance gets all of them and its
    ranks are not bound to cores (each rank's tuple is every core: `UNBOUND`). Binding rank r
    of two instances to the same core put both ranks' pinned threads (OpenMP, the
    connector's side channel, zmq and UCX threads inherit the binding) on one core: a TP 2
    pair on 2 cores took 35 s to over 150 s for a rank's first handshake, and 0.03-1 s
    unbound (BENCHMARKS "Tensor parallelism")."""
    tps = [prefill_tp] * num_prefill + [decode_tp] * num_decode
    if prefill_tp == decode_tp == 1:
        return [(c,) for c in split_cores(cores, num_prefill, num_decode)]
    ranks = sum(tps)
    if len(cores) >= ranks:
        per, out, first = len(cores) // ranks, [], 0
        for tp in tps:
            out.append(tuple(tuple(cores[(first + r) * per:(first + r + 1) * per])
                             for r in range(tp)))
            first += tp
        return out
    return [tuple(tuple(cores) for _ in range(tp)) for tp in tps]


#: ``VLLM_CPU_OMP_THREADS_BIND`` for ranks left to the kernel's scheduler (vLLM's word)
UNBOUND = "nobind"


def omp_threads_bind(rank_cores: tuple[tuple[int, ...], ...]) -> tuple[str, int]:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` and ``OMP_NUM_THREADS`` for ranks on
    ``rank_cores``: each rank's own cores ("0|1"), or `UNBOUND` with one OpenMP thread per
    rank when ranks share cores (`place_ranks`)."""
    seen: set[int] = set()
    for cores in rank_cores:
        if seen & set(cores):
            return UNBOUND, 1
        seen |= set(cores)
    return "|".join(",".join(map(str, r)) for r in rank_cores), len(rank_cores[0])


def visible_gpus() -> list[str]:
    """``CUDA_VISIBLE_DEVICES``'s entries when it is set, else the NVIDIA device nodes found
    (``/dev/nvidia<N>``, as numbers)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    try:
        nodes = os.listdir("/dev")
    except OSError:
        return []
    return sorted((n[6:] for n in nodes if re.fullmatch(r"nvidia\d+", n)), key=int)


def gpu_assignment(count: int, *, share: bool = False,
                   tps: list[int] | None = None) -> list[str]:
    """GPUs per instance (``CUDA_VISIBLE_DEVICES``, comma-separated): instance i takes
    ``tps[i]`` GPUs (its tensor-parallel size; default 1 each), in order. Fewer visible
    GPUs than that is refused unless ``share`` (then GPUs are reused, in order, mod the
    number visible; an instance's ranks on distinct GPUs while there are enough)."""
    tps = tps or [1] * count
    need = sum(tps)
    gpus = visible_gpus()
    if not gpus:
        raise ServingError("device cuda but no GPU visible (CUDA_VISIBLE_DEVICES empty, no "
                           "/dev/nvidia<N>); run with device cpu")
    if max(tps) > len(gpus):
        raise ServingError(f"tensor-parallel size {max(tps)} needs {max(tps)} GPUs per "
                           f"instance, {len(gpus)} visible ({','.join(gpus)}): lower the "
                           "size or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if len(gpus) < need and not share:
        raise ServingError(
            f"{count} api_servers need {need} GPUs, {len(gpus)} visible "
            f"({','.join(gpus)}): set CUDA_VISIBLE_DEVICES to {need} GPUs, start fewer "
            f"instances, or share them (share_gpus=True, serve-pd --share-gpus: GPUs reused "
            f"in order mod {len(gpus)}, with --gpu-memory-utilization sized for it)")
    out, first = [], 0
    for tp in tps:
        out.append(",".join(gpus[(first + r) % len(gpus)] for r in range(tp)))
        first += tp
    return out
