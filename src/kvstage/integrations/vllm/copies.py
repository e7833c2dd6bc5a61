"""The device side of the connector's d2h and h2d: vLLM's KV tensors as a kvstage `KVCache`.

Contract
--------
Primitives (torch only: importing this module never imports vLLM):
- `kvstage_groups(groups, device_caches)`: vLLM's KV cache groups (``(layer_names, spec)``
  with vLLM's spec objects, read by attribute) as kvstage groups, the block size taken
  from the tensors (kernel blocks: what the ids passed to the op count in).
- `page_rows(name, tensor, num_blocks, dtype)`: one layer as raw ``[num_blocks,
  page_elems]`` rows of its storage, so a layout that permutes the dims inside a block
  (vLLM's LBNHC view) copies the same bytes; state layers (int8 views strided by the
  padded page) as whole pages.
- `wrap_vllm_caches(kv_caches, groups, num_blocks)`: the `KVCache` the connector's pd/
  roles copy with (kvstage's `CopyEngine`: one ``copy_`` per run of blocks for every
  physical tensor at once when they are evenly spaced in one backing buffer, as vLLM
  0.32.0 allocates them, else one per run per tensor), against a block-major host
  buffer of the same bytes as the device pool.
- `unsupported(spec, model)` and `saved_by_chunk(spec)`: which vLLM specs kvstage copies,
  and which are saved chunk by chunk.

Ownership: vLLM owns the device tensors; the cache keeps views of them, no copy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvstage.cache import KVCache, layout_from_layers
from kvstage.layout import (
    DTYPES,
    FullAttentionSpec,
    KVSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
    dtype_name,
    storage_dtype,
)


def _page_bytes(t: torch.Tensor, num_blocks: int) -> int:
    """Bytes from one logical block of layer ``t`` to the next (``t`` lists
    ``num_blocks x r`` kernel blocks)."""
    return t.stride(0) * t.element_size() * (t.shape[0] // num_blocks)


def page_rows(name: str, t: torch.Tensor, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """``[num_blocks, page]`` rows of ``dtype`` over the bytes of layer ``t``'s LOGICAL
    blocks: vLLM hands attention layers as kernel blocks (``num_blocks x r`` rows of
    ``page / r``) and state layers as ``[num_blocks, 1, 1, state bytes]`` int8 views whose
    block stride is the padded page; both become the same rows of one page per block id of
    vLLM's block pool, so the ids of every group index one space."""
    if t.dim() < 2 or t.shape[0] % num_blocks:
        raise ValueError(
            f"layer {name!r}: expected [num_blocks x r, ...] with num_blocks {num_blocks}, got "
            f"shape {list(t.shape)}"
        )
    item = t.element_size()
    ratio = t.shape[0] // num_blocks
    page = _page_bytes(t, num_blocks)
    offset = t.storage_offset() * item
    reach = (ratio - 1) * t.stride(0) * item + sum(
        (n - 1) * st * item for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)
    ) + item
    storage = t.untyped_storage()
    if (page <= 0 or reach > page or offset + num_blocks * page > storage.nbytes()
            or page % dtype.itemsize or offset % dtype.itemsize):
        raise ValueError(
            f"layer {name!r} (shape {list(t.shape)}, stride {list(t.stride())}) is not "
            "[num_blocks, ...] with each block one dense range; kvstage's connector needs "
            "vLLM's block-first KV layouts"
        )
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    rows = raw.as_strided((num_blocks, page), (page, 1), offset)
    return rows.view(dtype) if dtype != torch.uint8 else rows


#: vLLM spec class -> how kvstage copies it (ChunkedLocalAttentionSpec keeps every block,
#: as full attention: a superset of what its layers read, byte-exact)
_ATTENTION_SPECS = {
    "FullAttentionSpec": "full", "SinkFullAttentionSpec": "full",
    "ChunkedLocalAttentionSpec": "full", "SlidingWindowSpec": "sliding_window",
    "MLAAttentionSpec": "mla",
}
#: vLLM's MambaAttentionBackendEnum member -> kvstage's MambaSpec.mamba_type
_MAMBA_TYPES = {
    "MAMBA1": "mamba1", "MAMBA2": "mamba2", "GDN_ATTN": "gdn_attention",
    "SHORT_CONV": "short_conv", "LINEAR": "linear_attention",
}
SUPPORTED_SPECS = (*_ATTENTION_SPECS, "MambaSpec (" + ", ".join(_MAMBA_TYPES) + ")")
#: the specs whose blocks never change once full and stay the request's until it ends (or
#: leave the transfer, a sliding window's, as vLLM's clip says): saved as they complete
#: (`prompt_saves`); the rest (state, chunked-local attention) at the prompt's end
_SAVED_BY_CHUNK = {"FullAttentionSpec", "SinkFullAttentionSpec", "MLAAttentionSpec",
                   "SlidingWindowSpec"}


def saved_by_chunk(vllm_spec: Any) -> bool:
    """Whether a group of ``vllm_spec`` (vLLM's spec object) is saved chunk by chunk."""
    return type(vllm_spec).__name__ in _SAVED_BY_CHUNK


def unsupported(vllm_spec: Any, model: str) -> str | None:
    """The one-line refusal for a vLLM spec kvstage cannot copy, or None."""
    kind = type(vllm_spec).__name__
    if kind == "MambaSpec":
        mtype = getattr(getattr(vllm_spec, "mamba_type", None), "name", None)
        if mtype in _MAMBA_TYPES:
            return None
        kind = f"MambaSpec({mtype})"
    elif kind in _ATTENTION_SPECS:
        return None
    return (
        f"kvstage does not handle {kind} layers ({model or 'this model'}); it copies "
        f"{', '.join(SUPPORTED_SPECS)}: serve this model with vLLM's own connector"
    )


def _spec(vllm_spec: Any, page_bytes: int, dtype: torch.dtype) -> KVSpec:
    """A kvstage spec for vLLM's ``vllm_spec`` (one `unsupported` let through) whose
    logical page is ``page_bytes``; an attention layer's dtype is its tensor's (``dtype``)."""
    if type(vllm_spec).__name__ == "MambaSpec":
        return MambaSpec(
            block_size=int(vllm_spec.block_size),
            shapes=tuple(tuple(int(n) for n in shape) for shape in vllm_spec.shapes),
            dtypes=tuple(dtype_name(d) for d in vllm_spec.dtypes),
            page_size_padded=page_bytes,
            mamba_type=_MAMBA_TYPES[vllm_spec.mamba_type.name],
            conv_layout=os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "DS").upper(),
            num_speculative_blocks=int(getattr(vllm_spec, "num_speculative_blocks", 0)),
        )
    name = dtype_name(dtype)
    item = DTYPES[name].itemsize
    heads, head = int(vllm_spec.num_kv_heads), int(vllm_spec.head_size)
    mla = _ATTENTION_SPECS[type(vllm_spec).__name__] == "mla"
    per_token = (head if mla else 2 * heads * head) * item
    if page_bytes % per_token:
        raise ValueError(
            f"a block of {page_bytes} B is not a whole number of tokens of {per_token} B "
            f"({type(vllm_spec).__name__}: {heads} heads x {head})"
        )
    block_size = page_bytes // per_token
    if mla:
        return MLASpec(block_size=block_size, head_size=head, dtype=name)
    window = getattr(vllm_spec, "sliding_window", None)
    if window and _ATTENTION_SPECS[type(vllm_spec).__name__] == "sliding_window":
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=heads, head_size=head,
                                 dtype=name, sliding_window=int(window))
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head,
                             dtype=name)


def kvstage_groups(
    groups: Sequence[tuple[Sequence[str], Any]],
    device_caches: Mapping[str, torch.Tensor],
    num_blocks: int | None = None,
    model: str = "",
) -> list[tuple[list[str], KVSpec]]:
    """vLLM's ``(layer_names, kv_cache_spec)`` per group -> kvstage ``(names, spec)``, pages
    sized per LOGICAL block (``num_blocks``: vLLM's ``kv_cache_config.num_blocks``; by
    default the first layer's rows). A spec kvstage cannot copy: ValueError, one line."""
    if num_blocks is None:
        num_blocks = int(device_caches[groups[0][0][0]].shape[0])
    for _names, vllm_spec in groups:  # every refusal before any work
        why = unsupported(vllm_spec, model)
        if why:
            raise ValueError(why)
    out = []
    for names, vllm_spec in groups:
        first = device_caches[names[0]]
        page = _page_bytes(first, num_blocks)
        out.append((list(names), _spec(vllm_spec, page, first.dtype)))
    return out


def wrap_vllm_caches(kv_caches: Mapping[str, torch.Tensor],
                     groups: Sequence[tuple[Sequence[str], Any]], num_blocks: int,
                     model: str = "") -> KVCache:
    """vLLM's ``{layer: tensor}`` and KV cache groups (``(layer_names, vLLM spec)``) as the
    `KVCache` the connector's roles copy from and to: every layer as ``[num_blocks,
    page_elems]`` rows of LOGICAL block ids (`page_rows`: every group's ids index one
    space), layers of different groups that share a tensor aliased as on the device. Its
    host side is ``HostBuffer.for_device(cache.layout, cache.device)``: block-major, the
    same bytes as the device pool."""
    kv_groups = kvstage_groups(groups, kv_caches, num_blocks, model)
    dtype = DTYPES[storage_dtype(spec for _, spec in kv_groups)]
    names = [n for g, _ in kv_groups for n in g]
    rows = {n: page_rows(n, kv_caches[n], num_blocks, dtype) for n in names}
    return KVCache.wrap_layers(layout_from_layers(rows, kv_groups), rows)
