"""The engine-neutral P/D library: the pieces a prefill/decode pair is made of.

Two clients use them. The CLI's roles (`prefill.PrefillWorker`, `decode.DecodeWorker`:
kvstage's own engine, demo and tests) use all of them. vLLM's connector
(`kvstage.integrations.vllm`, where vLLM keeps its scheduler, its READ path and its
handshake code) uses the ones below, each with the mode that fits it; nothing of these
concepts is implemented a second time there:

- `auth`: the shared key, sealed envelopes, and capabilities in two modes: issued (random,
  stored: the CLI's prefill) or derived (an HMAC of the request id: vLLM's scheduler hands it
  out, its worker checks it, no shared state);
- `side_channel`: the one ROUTER server and REQ round trip; vLLM's handshake listener and
  its sealed query run on them (raw mode: vLLM's payload, kvstage's envelope);
- `integrity` + `reads.pair_blocks`: per-block digests, their two wire forms (aligned lists
  in the CLI's messages, JSON in vLLM's ``kv_transfer_params``), the end-aligned pairing of
  remote and local ids (strict, or lenient over vLLM's already-paired READ) and the check;
- `lease`: the prefill's hold deadline and the decode's decision (bound the READ by the time
  left: the CLI; refuse to start within a margin: vLLM);
- `kvstage.plan.find_runs` (core): run-finding, for both copy paths.
"""
