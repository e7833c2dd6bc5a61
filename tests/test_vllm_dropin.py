"""kvstage.integrations.vllm.copy_blocks: byte-exact against vLLM's per-layer
copy_kv_blocks on aliasing per-layer dicts, one copy per distinct tensor per run, and
every bad input raising before a byte moves."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import fill_host_random
from kvstage import CacheLayout, HostBuffer, HostLayout, KVCache, preset
from kvstage.engine import vllm_copy_kv_blocks
from kvstage.integrations import vllm as vllm_integration
from kvstage.integrations.vllm import copy_blocks
from kvstage.ops import OpCounter

CONFIGS = [
    ("gemma-3-1b", CacheLayout.PACKED),
    ("gemma-3-1b", CacheLayout.KV_SPLIT),
    ("gpt-oss-20b", CacheLayout.KV_SPLIT),
    ("deepseek-v2-lite", CacheLayout.PACKED),
]
NB = 24


def _sides(name: str, cl: CacheLayout, seed: int) -> tuple[KVCache, HostBuffer]:
    lay = preset(name, num_blocks=NB, block_size=4, cache_layout=cl)
    cache, host = KVCache(lay), HostBuffer(lay, HostLayout.MIRROR)
    cache.fill_random(seed)
    fill_host_random(host, seed + 1)
    return cache, host


def _dicts(cache: KVCache, host: HostBuffer, direction: str) -> tuple[dict[str, Any], ...]:
    dev, hst = cache.layer_caches(), host.layer_views()
    return (dev, hst) if direction == "d2h" else (hst, dev)


def _bytes(cache: KVCache, host: HostBuffer) -> tuple[torch.Tensor, torch.Tensor]:
    return (cache.slab.view(torch.uint8).clone(), host.storage.view(torch.uint8).clone())


# src -> dst pairs: scattered, a different destination (runs where both sides advance)
SRC = [3, 4, 5, 9, 12, 13, 20, 1]
DST = [7, 8, 9, 2, 15, 16, 21, 23]  # runs: (3->7, 3), (9->2), (12->15, 2), (20->21), (1->23)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(("name", "cl"), CONFIGS, ids=[f"{n}-{c.value}" for n, c in CONFIGS])
def test_byte_exact_vs_vllm(name: str, cl: CacheLayout, direction: str) -> None:
    ours, ref = _sides(name, cl, seed=1), _sides(name, cl, seed=1)
    before = _bytes(*ours)
    src, dst = _dicts(*ours, direction)
    block_dim = cl.block_dim
    with OpCounter() as counter:
        copy_blocks(src, dst, SRC, DST, direction, block_dim=block_dim)  # type: ignore[arg-type]
    vllm_copy_kv_blocks(*_dicts(*ref, direction), SRC, DST, direction, block_dim=block_dim)
    after, expected = _bytes(*ours), _bytes(*ref)
    assert torch.equal(after[0], expected[0]) and torch.equal(after[1], expected[1])
    changed = 0 if direction == "h2d" else 1  # the destination side's bytes moved
    assert not torch.equal(after[changed], before[changed])
    assert torch.equal(after[1 - changed], before[1 - changed])  # source untouched
    # one slice copy per distinct physical tensor per run (not per layer name)
    tensors = ours[0].layout.num_tensors
    assert counter.data_counts() == {"copy_": tensors * 5}
    assert len(src) == ours[0].layout.num_layers  # vLLM loops over all of these


def test_gemma_op_count_is_tensors_not_layers() -> None:
    cache, host = _sides("gemma-3-1b", CacheLayout.PACKED, seed=2)
    src, dst = _dicts(cache, host, "d2h")
    ids = list(range(1, 11))
    with OpCounter() as ours:
        copy_blocks(src, dst, ids, ids, "d2h")
    with OpCounter() as vllm:
        vllm_copy_kv_blocks(src, dst, ids, ids, "d2h")
    assert ours.data_counts() == {"copy_": 4}  # 4 tensors x 1 run
    assert vllm.data_counts() == {"index": 26, "index_put_": 26}  # per layer name


def test_null_pairs_skipped_and_empty_is_noop() -> None:
    cache, host = _sides("gemma-3-1b", CacheLayout.PACKED, seed=3)
    before = _bytes(cache, host)
    src, dst = _dicts(cache, host, "d2h")
    with OpCounter() as counter:
        copy_blocks(src, dst, [0, 0, 5], [0, 0, 6], "d2h")
    assert counter.data_counts() == {"copy_": 4}
    host_block = host.canonical.view(torch.uint8)
    assert torch.equal(host_block[:, :, 6], cache.canonical.view(torch.uint8)[:, :, 5])
    mirror_before = before[1].view(host_block.shape)
    assert torch.equal(host_block[:, :, 0], mirror_before[:, :, 0])  # null block untouched
    for ids in ([], [0, 0]):
        with OpCounter() as counter:
            copy_blocks(src, dst, ids, ids, "h2d")
        assert counter.data_ops == 0
    assert torch.equal(cache.slab.view(torch.uint8), before[0])


def test_block_major_host_views_work_too() -> None:
    lay = preset("gemma-3-1b", num_blocks=NB, block_size=4)
    cache, host = KVCache(lay), HostBuffer(lay, HostLayout.BLOCK_MAJOR)
    cache.fill_random(4)
    copy_blocks(cache.layer_caches(), host.layer_views(), [2, 3, 8], [2, 3, 8], "d2h")
    for b in (2, 3, 8):
        assert torch.equal(host.canonical[:, :, b].contiguous().view(torch.uint8),
                           cache.canonical[:, :, b].contiguous().view(torch.uint8))


def test_no_vllm_import() -> None:
    tree = ast.parse(Path(vllm_integration.__file__).read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] == "vllm" for m in modules), modules
    assert "[num_blocks, 2, block_size, num_kv_heads, head_size]" in (copy_blocks.__doc__ or "")


# -- errors: raise, never return silently, and move nothing -----------------------------------


def _bad_cases() -> list[tuple[str, Any, type[Exception], str]]:
    cases: list[tuple[str, Any, type[Exception], str]] = [
        ("missing key", lambda s, d: ({k: v for k, v in s.items() if k != "layers.0"}, d,
                                      [1], [1], "d2h", {}),
         ValueError, "same layer names; missing in dst: \\[\\], only in dst: \\['layers.0'\\]"),
        ("empty src", lambda s, d: ({}, d, [1], [1], "d2h", {}), ValueError,
         "src_caches is empty"),
        ("empty dst", lambda s, d: (s, {}, [1], [1], "d2h", {}), ValueError,
         "dst_caches is empty"),
        ("not a dict", lambda s, d: (list(s.values()), d, [1], [1], "d2h", {}), TypeError,
         "src_caches must be a dict"),
        ("length mismatch", lambda s, d: (s, d, [1, 2], [1], "d2h", {}), ValueError,
         "src_block_ids has 2 ids, dst_block_ids has 1"),
        ("src out of range", lambda s, d: (s, d, [1, NB], [1, 2], "d2h", {}), ValueError,
         f"src_block_ids has id {NB} out of range.*hold {NB} blocks along dim 0"),
        ("dst out of range", lambda s, d: (s, d, [1, 2], [1, NB + 5], "d2h", {}), ValueError,
         f"dst_block_ids has id {NB + 5} out of range"),
        ("negative", lambda s, d: (s, d, [1, -1], [1, 2], "d2h", {}), ValueError,
         r"src_block_ids\[1\] is -1: block ids are >= 0"),
        ("duplicate dst", lambda s, d: (s, d, [1, 2], [5, 5], "d2h", {}), ValueError,
         "dst block 5 is written more than once"),
        ("direction", lambda s, d: (s, d, [1], [1], "sideways", {}), ValueError,
         "direction must be 'h2d' or 'd2h', got 'sideways'"),
        ("float id", lambda s, d: (s, d, [1.0], [1], "d2h", {}), TypeError,
         r"src_block_ids\[0\] must be an int block id, got float"),
        ("bool id", lambda s, d: (s, d, [1], [True], "d2h", {}), TypeError,
         r"dst_block_ids\[0\] must be an int block id, got bool"),
        ("ids not a list", lambda s, d: (s, d, "12", [1, 2], "d2h", {}), TypeError,
         "src_block_ids must be a list of ints"),
        ("shape differs", lambda s, d: (s, {**d, "layers.0": d["layers.0"][:-1]}, [1], [1],
                                        "d2h", {}),
         ValueError, r"layer 'layers.0': src is \(24, 2, 4, 1, 256\).*dst is \(23,"),
        ("dtype differs", lambda s, d: (s, {**d, "layers.0": d["layers.0"].view(torch.int16)},
                                        [1], [1], "d2h", {}),
         ValueError, "both sides need one shape and dtype"),
        ("non-tensor", lambda s, d: (s, {**d, "layers.0": "not a tensor"}, [1], [1],
                                     "d2h", {}),
         TypeError, r"dst_caches\['layers.0'\] must be a torch.Tensor, got str"),
        ("meta dst d2h", lambda s, d: (s, {k: v.to("meta") for k, v in d.items()}, [1], [1],
                                       "d2h", {}),
         ValueError, "d2h copies to the host: dst_caches must be on the CPU, got meta"),
        ("meta src h2d", lambda s, d: ({k: v.to("meta") for k, v in s.items()}, d, [1], [1],
                                       "h2d", {}),
         ValueError, "h2d copies from the host: src_caches must be on the CPU, got meta"),
        ("aliasing differs", lambda s, d: (s, {k: v.clone() for k, v in d.items()}, [1], [1],
                                           "d2h", {}),
         ValueError, "layers that alias one tensor in src_caches must alias"),
        ("overlapping dst", lambda s, d: (s, {**d, "layers.0": d["layers.0"][:1].expand(
            NB, *d["layers.0"].shape[1:])}, [1], [1], "d2h", {}),
         ValueError, r"dst_caches\['layers.0'\] has elements that overlap in memory"),
        ("block_dim too big", lambda s, d: (s, d, [1], [1], "d2h", {"block_dim": 5}),
         ValueError, "block_dim 5 is out of range"),
        ("block_dim negative", lambda s, d: (s, d, [1], [1], "d2h", {"block_dim": -1}),
         TypeError, "block_dim must be an int >= 0"),
    ]
    return cases


BAD = _bad_cases()


@pytest.mark.parametrize(("what", "make", "exc", "match"), BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_and_move_nothing(what: str, make: Any, exc: type[Exception],
                                           match: str) -> None:
    cache, host = _sides("gemma-3-1b", CacheLayout.PACKED, seed=9)
    before = _bytes(cache, host)
    src, dst = cache.layer_caches(), host.layer_views()
    s, d, sids, dids, direction, kw = make(src, dst)
    with pytest.raises(exc, match=match):
        copy_blocks(s, d, sids, dids, direction, **kw)
    after = _bytes(cache, host)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]), what


def test_validation_precedes_any_copy() -> None:
    """A bad id late in the list must not let the earlier (valid) runs through."""
    cache, host = _sides("gemma-3-1b", CacheLayout.PACKED, seed=10)
    before = _bytes(cache, host)
    with pytest.raises(ValueError, match="out of range"):
        copy_blocks(cache.layer_caches(), host.layer_views(), [1, 2, 3, 99], [1, 2, 3, 4],
                    "d2h")
    assert torch.equal(_bytes(cache, host)[1], before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_cuda_byte_exact_vs_vllm(direction: str) -> None:
    lay = preset("gemma-3-1b", num_blocks=NB, block_size=4)
    ours = (KVCache(lay, "cuda"), HostBuffer.for_device(lay, "cuda", HostLayout.MIRROR))
    ref = (KVCache(lay, "cuda"), HostBuffer.for_device(lay, "cuda", HostLayout.MIRROR))
    for cache, host in (ours, ref):
        cache.fill_random(1)
        fill_host_random(host, 2)
    copy_blocks(*_dicts(*ours, direction), SRC, DST, direction)  # type: ignore[arg-type]
    vllm_copy_kv_blocks(*_dicts(*ref, direction), SRC, DST, direction)
    assert torch.equal(ours[0].slab.view(torch.uint8).cpu(), ref[0].slab.view(torch.uint8).cpu())
    assert torch.equal(ours[1].storage.view(torch.uint8), ref[1].storage.view(torch.uint8))


def test_ids_checked_along_block_dim_of_kv_split() -> None:
    cache, host = _sides("gemma-3-1b", CacheLayout.KV_SPLIT, seed=11)
    before = _bytes(cache, host)
    src, dst = cache.layer_caches(), host.layer_views()
    # [2, NB, ...]: with the wrong block_dim 0 only ids 0 and 1 exist
    with pytest.raises(ValueError, match="hold 2 blocks along dim 0, ids must be in \\[0, 2\\)"):
        copy_blocks(src, dst, [3], [3], "d2h", block_dim=0)
    with pytest.raises(ValueError, match=f"hold {NB} blocks along dim 1"):
        copy_blocks(src, dst, [NB], [1], "d2h", block_dim=1)
    after = _bytes(cache, host)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
