"""Asynchronous requests inside a `vllm_engines.VLLMEngine` child: submit, step, abort.

`VLLMEngine.generate` runs one blocking ``LLM.generate``; a fault test needs a request
left in flight (a decode waiting on a READ a stopped prefill will not serve), aborted like
a client that gives up, while the test observes the engine between steps. These ops do
that with vLLM's own ``LLMEngine`` calls (``add_request``, ``step``, ``abort_request``):

- ``submit``: add requests (ids chosen by the test) and return at once;
- ``step``: step the engine ``steps`` times, ``interval_s`` apart, and report the outputs
  that finished meanwhile, the requests still unfinished and the free block count;
- ``abort``: abort requests by id, as vLLM's API server does when a client disconnects;
- ``kv_shapes``: every worker's (tensor-parallel rank's) KV cache as vLLM bound it to its
  layers: per layer name, the tensors' shapes and dtypes (an attention layer's KV tensor; a
  Mamba / linear-attention layer's state views) and the layer's per-rank KV head count.

Contract: runs in the child only (the one place vLLM is imported); one caller (the
child's request loop). Every op returns one JSON-able message (``kind`` = the op).
"""

from __future__ import annotations

import time
from typing import Any

OPS = ("submit", "step", "abort", "kv_shapes")


def run_op(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Dispatch one op message (``request["op"]`` in `OPS`)."""
    op = request["op"]
    if op == "submit":
        return _submit(llm, request)
    if op == "step":
        return _step(llm, int(request["steps"]), float(request["interval_s"]))
    if op == "abort":
        llm.llm_engine.abort_request(list(request["request_ids"]))
        return {"kind": "abort"}
    if op == "kv_shapes":
        return {"kind": "kv_shapes", "ranks": llm.collective_rpc(_worker_kv_shapes)}
    raise ValueError(f"unknown engine op {op!r}; expected one of {OPS}")


def held(llm: Any, steps: int, interval_s: float) -> dict[str, Any]:
    """Runs in the child: step the in-process engine core, report its held requests."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for _ in range(steps):
        if scheduler.has_requests():
            llm.llm_engine.step()
        time.sleep(interval_s)
    ids = sorted(rid for rid, r in scheduler.requests.items() if r.is_finished())
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return {"kind": "held", "request_ids": ids, "free_blocks": free}


def _submit(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for rid, prompt, kv in zip(request["request_ids"], request["prompts"],
                               request["kv_transfer_params"], strict=True):
        params = SamplingParams(
            temperature=0.0, max_tokens=request["max_tokens"], logprobs=request["logprobs"],
            detokenize=False,
            extra_args={"kv_transfer_params": kv} if kv is not None else None,
        )
        llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    return {"kind": "submit"}


def _step(llm: Any, steps: int, interval_s: float) -> dict[str, Any]:
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    finished = []
    preempted: dict[str, int] = {}  # request id -> times vLLM preempted it (so far)
    for _ in range(steps):
        for rid, req in scheduler.requests.items():
            if getattr(req, "num_preemptions", 0):
                preempted[rid] = max(preempted.get(rid, 0), req.num_preemptions)
        # an aborted request the scheduler still holds (its READ in flight) is no longer
        # "unfinished" for the front end, but its engine must keep stepping to poll NIXL
        if engine.has_unfinished_requests() or scheduler.has_requests():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    finished.append({
                        "request_id": o.request_id,
                        "token_ids": list(c.token_ids),
                        "finish_reason": c.finish_reason,
                        "kv_transfer_params": o.kv_transfer_params,
                    })
        time.sleep(interval_s)
    return {
        "kind": "step",
        "finished": finished,
        "unfinished": sorted(scheduler.requests),
        "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "preempted": preempted,
    }


def _worker_kv_shapes(worker: Any) -> dict[str, Any]:
    """Runs in each worker (``LLM.collective_rpc``): its rank and, per layer holding a KV
    cache, ``{"tensors": [[shape, dtype], ...], "num_kv_heads": per-rank heads or None}``."""
    import torch

    def tensors(value: Any) -> list[list[Any]]:
        if isinstance(value, torch.Tensor):
            return [[list(value.shape), str(value.dtype).removeprefix("torch.")]]
        if isinstance(value, list | tuple):
            return [t for v in value for t in tensors(v)]
        return []

    context = worker.vllm_config.compilation_config.static_forward_context
    layers = {}
    for name, layer in sorted(context.items()):
        found = tensors(getattr(layer, "kv_cache", None))
        if found:
            layers[name] = {"tensors": found,
                            "num_kv_heads": getattr(layer, "num_kv_heads", None)}
    return {"rank": int(getattr(worker, "rank", 0)), "layers": layers}
