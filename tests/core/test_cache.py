"""KVCache over engine-owned tensors: wrap, wrap_layers, layout_from_layers, and the fused
copy's op counts over separate allocations vs one slab."""

from __future__ import annotations

import pytest
import torch

from kvstage import (
    CacheLayout,
    CopyEngine,
    Direction,
    HostBuffer,
    KVCache,
    layout_from_layers,
    preset,
)
from kvstage.errors import LayoutMismatch
from kvstage.testing.opcount import OpCounter

GEMMA = preset("gemma-3-1b", num_blocks=64)


def vllm_style_caches(layout, *, slab: bool = False, seed: int = 0):  # type: ignore[no-untyped-def]
    """Tensors as vLLM allocates them: one per physical tensor (or one backing slab), and a
    ``{layer_name: tensor}`` dict in which layer t of every group aliases tensor t."""
    gen = torch.Generator().manual_seed(seed)
    shape = layout.layer_shape
    if slab:
        backing = torch.randn((layout.num_tensors, *shape), generator=gen).to(layout.torch_dtype)
        tensors = list(backing.unbind(0))
    else:
        tensors = [torch.randn(shape, generator=gen).to(layout.torch_dtype)
                   for _ in range(layout.num_tensors)]
    layers = {name: tensors[t] for g in layout.groups for t, name in enumerate(g.layer_names)}
    return tensors, layers


def test_layout_from_layers_dedupes_26_names_over_4_tensors() -> None:
    _, layers = vllm_style_caches(GEMMA)
    groups = [(g.layer_names, g.spec) for g in GEMMA.groups]
    derived = layout_from_layers(layers, groups, name="gemma-3-1b")
    assert derived.num_tensors == 4 and derived.num_layers == 26
    assert derived == GEMMA  # same grouping, same order of tensors, same specs
    # names listed in another order inside each group: reordered by storage, so that
    # position t of every group names one physical tensor again
    rotated = [(g.layer_names[1:] + g.layer_names[:1], g.spec) for g in GEMMA.groups]
    again = layout_from_layers(layers, rotated)
    for pt in again.tensors:
        assert len({layers[n].data_ptr() for n in pt.layer_names}) == 1
    cache = KVCache.wrap_layers(derived, layers)
    assert not cache.owned and cache.canonical is None  # four separate allocations
    for name, view in cache.layer_caches().items():
        assert view.data_ptr() == layers[name].data_ptr()


def test_layout_from_layers_refuses_two_layers_of_a_group_on_one_storage() -> None:
    tensors, layers = vllm_style_caches(GEMMA)
    layers["layers.7"] = layers["layers.0"]  # group 0 holds both
    with pytest.raises(LayoutMismatch, match="two layers of one group alias one storage"):
        layout_from_layers(layers, [(g.layer_names, g.spec) for g in GEMMA.groups])


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        (lambda t: t[:3], "got 3 tensors, the layout has 4 physical tensors"),
        (lambda t: [t[0].to(torch.float32), *t[1:]], "dtype torch.float32"),
        (lambda t: [t[0][:10], *t[1:]], "elements"),
        (lambda t: [t[0].transpose(0, 1).contiguous().transpose(0, 1), *t[1:]],
         "not laid out as \\[num_blocks, ...\\]"),
    ],
    ids=["count", "dtype", "size", "permuted"],
)
def test_wrap_refuses_tensors_that_do_not_fit(tensors, match) -> None:  # type: ignore[no-untyped-def]
    own, _ = vllm_style_caches(GEMMA)
    with pytest.raises(LayoutMismatch, match=match):
        KVCache.wrap(GEMMA, tensors(own))


@pytest.mark.parametrize("slab", [False, True], ids=["separate", "slab"])
@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
def test_fused_copy_over_engine_tensors_is_exact_with_one_op_per_run(
    slab: bool, direction: Direction
) -> None:
    tensors, layers = vllm_style_caches(GEMMA, slab=slab, seed=3)
    cache = KVCache.wrap(GEMMA, tensors)
    assert (cache.canonical is not None) is slab
    host = HostBuffer(GEMMA)
    host.storage.view(torch.uint8).copy_(
        torch.randint(0, 256, host.storage.view(torch.uint8).shape, dtype=torch.uint8))
    engine = CopyEngine(cache, host)
    ids = [[5, 6, 7], [8, 9], [], [], [], [], [20, 30]]  # runs: 5..9, 20, 30
    before_dev = [t.clone() for t in tensors]
    before_host = host.storage.clone()
    with OpCounter() as ops:
        engine.copy(ids, direction)
    runs = 3
    assert ops.data_counts() == {"copy_": runs * (1 if slab else GEMMA.num_tensors)}
    flat = [b for g in ids for b in g]
    host_t = host.canonical  # [T, P, NB, E]
    for t, dev in enumerate(tensors):
        dev_blocks = dev.view(1, GEMMA.num_blocks, -1)
        for b in range(GEMMA.num_blocks):
            if direction is Direction.D2H:
                want = dev_blocks[:, b] if b in flat else before_host.permute(1, 2, 0, 3)[t, :, b]
                assert torch.equal(host_t[t, :, b].view(torch.uint8), want.view(torch.uint8))
            else:
                want = host_t[t, :, b] if b in flat else before_dev[t].view(1, GEMMA.num_blocks,
                                                                            -1)[:, b]
                assert torch.equal(dev_blocks[:, b].view(torch.uint8), want.view(torch.uint8))


def test_kv_split_engine_tensors() -> None:
    lay = preset("gpt-oss-20b", num_blocks=16, cache_layout=CacheLayout.KV_SPLIT)
    tensors, layers = vllm_style_caches(lay, seed=5)
    assert tensors[0].shape[:2] == (2, 16)  # [2, num_blocks, ...]
    cache = KVCache.wrap_layers(lay, layers)
    host = HostBuffer(lay)
    CopyEngine(cache, host).save_to_host([[3, 4], [7]])
    for t, dev in enumerate(tensors):
        for b in (3, 4, 7):
            assert torch.equal(host.canonical[t, :, b], dev.view(2, 16, -1)[:, b])
