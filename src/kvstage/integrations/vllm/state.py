"""State-group hybrids (Mamba1/2, gated delta net, short conv, linear attention) on the
connector's host path: what to refuse at start, and which ids the d2h/h2d copy.

Contract
--------
Primitives (importing this module never imports vLLM; vLLM objects are read by attribute):
- `refuse_unservable(vllm_config, kv_cache_config)`: raises ValueError, one line, for a
  model whose layers kvstage cannot copy (`copies.unsupported`: the spec and the model
  named) or a Mamba model without vLLM's DS conv-state layout (vLLM's NIXL worker asserts
  it deep in its start; the fix is named here: ``VLLM_SSM_CONV_STATE_LAYOUT=DS`` on both
  instances, which `kvstage serve-pd` sets).
- `logical_ids(groups, ratio, is_state)`: a request's per-group ids as ONE flat list of
  vLLM block-pool ids. vLLM's worker lists attention groups in kernel blocks (logical id b
  -> b*r .. b*r+r-1 when the attention kernel block is r times smaller) and state groups in
  logical blocks: two index spaces that collide once r > 1 (vLLM flattens them anyway).
  Folding kernel ids back (b = k // r) gives ids of one space, where each id names one
  logical page of every physical tensor: what `copies.EngineCopyOp` copies.
- `copy_logical(worker, direction, requests)`: the worker's metered ``copy_blocks`` over
  those ids, one call per request, as vLLM's own save/sync do (synchronous: vLLM's host
  path expects the bytes in place on return).

Why whole logical pages are exact: a logical block id is held by one group of one request
(one shared block pool), so its page of every physical tensor is that request's bytes or
unused; a state slot is rewritten in place by every chunk, and the prefill saves once,
after its last chunk (scheduler.py), so the slot moved is the state after the prompt vLLM
computed (vLLM's protocol stops the prefill one token short for Mamba: h(N-1)).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstage.integrations.vllm.copies import unsupported

DS_FIX = "set VLLM_SSM_CONV_STATE_LAYOUT=DS on both instances (kvstage serve-pd sets it)"


def state_group_flags(kv_cache_config: Any) -> tuple[bool, ...]:
    """Per KV cache group: True for a state (MambaSpec) group."""
    return tuple(
        type(g.kv_cache_spec).__name__ == "MambaSpec" for g in kv_cache_config.kv_cache_groups
    )


def refuse_unservable(vllm_config: Any, kv_cache_config: Any) -> None:
    model = str(getattr(getattr(vllm_config, "model_config", None), "model", "") or "")
    for group in kv_cache_config.kv_cache_groups:
        why = unsupported(group.kv_cache_spec, model)
        if why:
            raise ValueError(why)
    if any(state_group_flags(kv_cache_config)):
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        if not is_conv_state_dim_first():
            raise ValueError(
                f"{model or 'this model'} has Mamba/SSM state layers and the conv state is "
                f"laid out (state_len, dim): vLLM's NIXL transfer needs (dim, state_len); "
                f"{DS_FIX}"
            )


def logical_ids(
    groups: Sequence[Sequence[int]], ratio: int, is_state: Sequence[bool]
) -> list[int]:
    """Per-group ids (attention groups in kernel blocks, state groups logical) -> one flat
    list of logical block ids, in order, each once (the null block 0 kept as vLLM lists it:
    the copy skips it)."""
    if ratio == 1:
        return [b for g in groups for b in g]
    out: list[int] = []
    seen: set[int] = set()
    for ids, state in zip(groups, is_state, strict=True):
        for k in ids:
            b = k if state else k // ratio
            if b not in seen:
                seen.add(b)
                out.append(b)
    return out


def copy_logical(worker: Any, direction: str, requests: Sequence[list[int]]) -> None:
    """``worker.copy_blocks`` (d2h: device -> host) over each request's logical ids."""
    assert worker.copy_blocks is not None
    src, dst = worker.device_kv_caches, worker.host_xfer_buffers
    if direction == "h2d":
        src, dst = dst, src
    for ids in requests:
        worker.copy_blocks(src, dst, ids, ids, direction)
