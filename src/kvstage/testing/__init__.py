"""Support for kvstage's tests, benches, demo and CLI: never on the product path.

- `pattern`: a verifiable KV pattern (the CLI/demo/tests' stand-in forward pass).
- `baselines`: vLLM's copy ops, faithfully, for comparisons.
- `opcount`: a TorchDispatchMode that counts ops and peak temporary bytes.
- `servers`: a background prefill (thread or child process) with one orphan guard.
"""
