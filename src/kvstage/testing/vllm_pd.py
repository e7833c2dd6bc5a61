"""P/D through two `kvstage.testing.vllm_engines.VLLMEngine` children, as a proxy runs it:
`generate_pd` prefills each prompt on one engine (one token, the proxy's
``PREFILL_REQUEST_PARAMS``) and decodes it on the other with the prefill's
``kv_transfer_params``. Parent side: no vLLM import; every wait bounded by ``timeout``."""

from __future__ import annotations

from kvstage.testing.vllm_engines import (
    PREFILL_REQUEST_PARAMS,
    Completion,
    EngineError,
    VLLMEngine,
)

__all__ = ["generate_pd"]


def generate_pd(
    prefill: VLLMEngine,
    decode: VLLMEngine,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    logprobs: int = 5,
    timeout: float = 240.0,
) -> list[Completion]:
    """Prefill on one engine (1 token), then decode on the other with the prefill's params."""
    first = prefill.generate(
        prompts, max_tokens=1, logprobs=logprobs, timeout=timeout,
        kv_transfer_params=[dict(PREFILL_REQUEST_PARAMS) for _ in prompts],
    )
    params = []
    for i, c in enumerate(first):
        if not c.kv_transfer_params:
            raise EngineError(f"prefill returned no kv_transfer_params for prompt {i}")
        params.append(c.kv_transfer_params)
    return decode.generate(
        prompts, max_tokens=max_tokens, logprobs=logprobs, kv_transfer_params=params,
        timeout=timeout,
    )
