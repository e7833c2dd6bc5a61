"""The requests `kvstage bench copy` times: synthetic layouts with B blocks split over G
groups (contiguous ids, or ids from a churned pool), or a preset's prompt as vLLM holds
it (every group allocates, sliding-window groups keep their window)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstage.blocks import BlockPool, clip_to_window, request_blocks
from kvstage.layout import KVLayout, cdiv
from kvstage.presets import preset, synthetic_layout


@dataclass
class Case:
    """One layout and one request's per-group ids."""

    label: str
    layout: KVLayout
    groups: list[list[int]]
    meta: dict[str, Any] = field(default_factory=dict)


def _churned_pool(num_blocks: int, seed: int) -> BlockPool:
    """A pool after many allocate/free cycles, so its free queue order is scrambled."""
    pool, rng = BlockPool(num_blocks), np.random.default_rng(seed)
    held: list[list[int]] = []
    for _ in range(4 * num_blocks):
        if held and (rng.random() < 0.5 or pool.num_free < 8):
            pool.free(held.pop(int(rng.integers(len(held)))))
        else:
            held.append(pool.allocate(int(rng.integers(1, min(8, pool.num_free) + 1))))
    for k in rng.permutation(len(held)):
        pool.free(held[k])
    return pool


def _split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    bounds = np.cumsum([0, *sizes])
    return [ids[bounds[g] : bounds[g + 1]] for g in range(len(sizes))]


def synthetic_num_blocks(args: argparse.Namespace) -> int:
    """The pool of a synthetic case: ``--num-blocks``, else room for the request's ids
    and a churned pool's scatter."""
    b = args.blocks_per_request
    return int(args.num_blocks or (max(32, 2 * b + 1) if args.quick else max(256, 4 * b + 1)))


def prompt_layout(args: argparse.Namespace, tokens: int) -> KVLayout:
    """The preset at the pool of a ``tokens`` prompt case: ``--num-blocks``, else every
    group's full allocation before sliding-window clipping, plus the null block."""
    probe = preset(args.preset, num_blocks=2)
    full = cdiv(tokens, probe.block_size)
    return preset(args.preset, num_blocks=args.num_blocks or probe.num_groups * full + 1)


def case_sizes(args: argparse.Namespace) -> list[tuple[KVLayout, int]]:
    """(layout, blocks in the request) of every case, without building any (no pool, no
    churn): what `kvstage bench copy` checks against the free memory first."""
    if args.preset:
        out = []
        for tokens in args.prompt_tokens:
            layout = prompt_layout(args, tokens)
            out.append((layout, sum(request_blocks(layout, tokens))))
        return out
    num_blocks = synthetic_num_blocks(args)
    return [(synthetic_layout(num_layers=n, num_groups=g, num_blocks=num_blocks),
             args.blocks_per_request) for n in args.num_layers for g in args.groups]


def build_cases(args: argparse.Namespace) -> list[Case]:
    if args.preset:
        return [_prompt_case(args, tokens) for tokens in args.prompt_tokens]
    b = args.blocks_per_request
    num_blocks = synthetic_num_blocks(args)
    cases = []
    for num_layers in args.num_layers:
        for g in args.groups:
            layout = synthetic_layout(num_layers=num_layers, num_groups=g, num_blocks=num_blocks)
            sizes = [len(a) for a in np.array_split(np.arange(b), g)]
            if args.ids == "contiguous":
                flat = list(range(1, b + 1))  # block 0 is the null block
            else:
                flat = _churned_pool(num_blocks, args.seed).allocate(b)
            meta = {"num_layers": num_layers, "groups": g, "num_tensors": layout.num_tensors,
                    "blocks_per_group": _compact(sizes)}
            cases.append(Case(f"{num_layers}L {g}G", layout, _split(flat, sizes), meta))
    return cases


def _prompt_case(args: argparse.Namespace, tokens: int) -> Case:
    """A prompt's ids as vLLM holds them: every group allocates cdiv(tokens, block_size)
    blocks group by group, then sliding-window groups keep their window (clip_to_window)
    and free the rest."""
    layout = prompt_layout(args, tokens)
    num_blocks = layout.num_blocks
    full = cdiv(tokens, layout.block_size)
    scattered = args.ids == "scattered"
    pool = _churned_pool(num_blocks, args.seed) if scattered else BlockPool(num_blocks)
    allocated = [pool.allocate(full) for _ in layout.groups]
    kept = clip_to_window(allocated, layout)
    for ids, keep in zip(allocated, kept, strict=True):
        pool.free(ids[: len(ids) - len(keep)])
    sizes = [len(k) for k in kept]
    assert sizes == request_blocks(layout, tokens), (sizes, request_blocks(layout, tokens))
    meta = {"prompt_tokens": tokens, "groups": layout.num_groups, "num_layers": layout.num_layers,
            "num_tensors": layout.num_tensors, "blocks_per_group": _compact(sizes)}
    return Case(f"{args.preset} {tokens} tok", layout, kept, meta)


def _compact(sizes: list[int]) -> str:
    """[33, 33, 33, 128] -> '[33x3, 128]' (the PR review's notation)."""
    parts, k = [], 0
    while k < len(sizes):
        n = 1
        while k + n < len(sizes) and sizes[k + n] == sizes[k]:
            n += 1
        parts.append(f"{sizes[k]}x{n}" if n > 1 else str(sizes[k]))
        k += n
    return "[" + ", ".join(parts) + "]"
