"""Asynchronous requests inside a `vllm_engines.VLLMEngine` child: submit, step, abort.

`VLLMEngine.generate` runs one blocking ``LLM.generate``; a fault test needs a request
left in flight (a decode waiting on a READ a stopped prefill will not serve), aborted like
a client that gives up, while the test observes the engine between steps. These ops do
that with vLLM's own ``LLMEngine`` calls (``add_request``, ``step``, ``abort_request``):

- ``submit``: add requests (ids chosen by the test) and return at once;
- ``step``: step the engine ``steps`` times, ``interval_s`` apart, and report the outputs
  that finished meanwhile, the requests still unfinished and the free block count;
- ``abort``: abort requests by id, as vLLM's API server does when a client disconnects.

Contract: runs in the child only (the one place vLLM is imported); one caller (the
child's request loop). Every op returns one JSON-able message (``kind`` = the op).
"""

from __future__ import annotations

import time
from typing import Any

OPS = ("submit", "step", "abort")


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
    raise ValueError(f"unknown engine op {op!r}; expected one of {OPS}")


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
