"""Support for kvstage's tests, benches, demo and CLI: never on the product path.

- `pattern`: a verifiable KV pattern (the CLI/demo/tests' stand-in forward pass).
- `baselines`: vLLM's copy ops, faithfully, for comparisons.
- `opcount`: a TorchDispatchMode that counts ops and peak temporary bytes.
- `servers`: a background prefill (thread or child process) with one orphan guard.
- `tiny_gemma3`, `vllm_engines`, `vllm_baseline`: the real-vLLM test harness (a tiny
  hybrid model built locally, engines in child processes, vLLM's own host path).
"""
