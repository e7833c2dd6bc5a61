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
- Ids: the connector copies a request's ids as the SCHEDULER lists them (vLLM block-pool
  ids, one space for every group), not vLLM's worker-side kernel ids (attention groups
  expanded b -> b*r .. b*r+r-1 when the attention kernel block is r times smaller, state
  groups left logical: two index spaces that collide once r > 1). Each logical id names
  one logical page of every physical tensor (`copies.page_rows`).

Why whole logical pages are exact: a logical block id is held by one group of one request
(one shared block pool), so its page of every physical tensor is that request's bytes or
unused; a state slot is rewritten in place by every chunk, and the prefill saves it after
its last chunk only (`kvstage.pd.prompt_saves`), so the slot moved is the state after the
prompt vLLM computed (the prefill stops one token short for Mamba: h(N-1)).
"""

from __future__ import annotations

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
