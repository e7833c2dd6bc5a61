"""The vLLM drop-in refuses what vLLM's op cannot do, before a byte moves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kvstage as ks
from tests.helpers import raw_bytes


def dropin_caches(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """gemma-3-1b-like dicts: 26 layer names over 4 physical tensors on each side."""
    layout = ks.preset("gemma-3-1b", num_blocks=16, block_size=4)
    cache, host = ks.KVCache(layout), ks.HostBuffer(layout, ks.HostLayout.MIRROR)
    cache.fill_random(seed)
    return cache.layer_caches(), host.layer_views()


def dict_bytes(caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [raw_bytes(t) for t in caches.values()]


def assert_dicts_unchanged(caches: dict[str, torch.Tensor], before: list[torch.Tensor]) -> None:
    assert all(torch.equal(raw_bytes(t), b) for t, b in zip(caches.values(), before, strict=True))


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda s, d, i: (s, d, [1, 2, 3], [4, 5]),
         "src_block_ids has 3 ids, dst_block_ids has 2; they pair one to one"),
        (lambda s, d, i: ({}, d, i, i), "src_caches is empty: pass one tensor per layer name"),
        (lambda s, d, i: (s, {}, i, i), "dst_caches is empty: pass one tensor per layer name"),
        (lambda s, d, i: (s, d, [1, 16], [2, 3]),
         "src_block_ids has id 16 out of range: the src tensors hold 16 blocks along dim 0, "
         "ids must be in [0, 16)"),
        (lambda s, d, i: (s, d, [1, -2], [2, 3]), "src_block_ids[1] is -2: block ids are >= 0"),
        (lambda s, d, i: (s, dict(list(d.items())[:-1]), i, i),
         "src_caches and dst_caches must have the same layer names"),
        (lambda s, d, i: (s, {k: v.to(torch.float16) for k, v in d.items()}, i, i),
         "both sides need one shape and dtype"),
    ],
    ids=["length-mismatch", "empty-src", "empty-dst", "out-of-range", "negative",
         "layer-names", "dtype"],
)
def test_dropin_copy_blocks_refuses(mutate: Any, expected: str) -> None:
    from kvstage.integrations.vllm import copy_blocks

    src, dst = dropin_caches()
    src_before, dst_before = dict_bytes(src), dict_bytes(dst)
    s, d, si, di = mutate(src, dst, [1, 2])
    with pytest.raises(ValueError) as err:
        copy_blocks(s, d, si, di, "d2h")
    assert expected in str(err.value)
    assert_dicts_unchanged(src, src_before)
    assert_dicts_unchanged(dst, dst_before)


def test_dropin_wrong_device_and_types() -> None:
    from kvstage.integrations.vllm import copy_blocks

    src, dst = dropin_caches()
    src_before, dst_before = dict_bytes(src), dict_bytes(dst)
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in dst.items()}
    with pytest.raises(ValueError, match="d2h copies to the host: dst_caches must be on the "
                       "CPU, got meta"):
        copy_blocks(src, meta, [1], [2], "d2h")
    with pytest.raises(ValueError, match="h2d copies from the host: src_caches must be on the "
                       "CPU, got meta"):
        copy_blocks(meta, dst, [1], [2], "h2d")
    mixed = dict(src)
    mixed["layers.0"] = torch.empty(src["layers.0"].shape, dtype=src["layers.0"].dtype,
                                    device="meta")
    with pytest.raises(ValueError, match="src_caches span devices"):
        copy_blocks(mixed, dst, [1], [2], "d2h")
    with pytest.raises(ValueError, match="direction must be 'h2d' or 'd2h', got 'sideways'"):
        copy_blocks(src, dst, [1], [2], "sideways")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"src_block_ids\[0\] must be an int block id, got "
                       "float 1.0"):
        copy_blocks(src, dst, [1.0], [2], "d2h")  # type: ignore[list-item]
    with pytest.raises(TypeError, match="dst_caches\\['layers.0'\\] must be a torch.Tensor"):
        copy_blocks(src, {k: v.tolist() for k, v in dst.items()}, [1], [2], "d2h")  # type: ignore[misc]
    assert_dicts_unchanged(src, src_before)
    assert_dicts_unchanged(dst, dst_before)


def test_dropin_non_contiguous_views_copy_exactly() -> None:
    """A strided (transposed) view is a valid cache: accepted, and every byte lands."""
    from kvstage.integrations.vllm import copy_blocks

    src = {"a": torch.randn(2, 8, 4, 1, 4).transpose(0, 1)}  # [8, 2, 4, 1, 4], strided
    assert not src["a"].is_contiguous()
    dst = {"a": torch.zeros(8, 2, 4, 1, 4)}
    before = dst["a"].clone()
    copy_blocks(src, dst, [1, 2, 6], [3, 4, 0], "d2h")
    want = before.clone()
    want[[3, 4, 0]] = src["a"][[1, 2, 6]]
    assert torch.equal(dst["a"], want)


def test_dropin_refuses_overlapping_destination() -> None:
    """Stride 0 along the blocks: dst blocks 3 and 5 would share bytes and one would
    silently overwrite the other."""
    from kvstage.integrations.vllm import copy_blocks

    src = {"a": torch.randn(8, 2, 4, 1, 4)}
    dst = {"a": torch.zeros(1, 2, 4, 1, 4).expand(8, 2, 4, 1, 4)}
    before = raw_bytes(dst["a"])
    with pytest.raises(ValueError, match=r"dst_caches\['a'\] has elements that overlap in "
                       r"memory \(stride \(0, 16, 4, 4, 1\)"):
        copy_blocks(src, dst, [1, 2], [3, 5], "d2h")
    assert torch.equal(raw_bytes(dst["a"]), before)
