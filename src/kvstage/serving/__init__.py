"""Serve with vLLM: start and stop a P/D deployment (api_servers + vllm-router) as users do.

`PDCluster` (N prefill + M decode ``vllm serve`` api_servers with kvstage's connector, and
vllm-router in front), `single_instance` (one plain api_server, the reference), `complete`
(a small concurrent /v1/completions client returning token ids). ``kvstage serve-pd`` is
the command line over `PDCluster`. Nothing here imports vLLM, CUDA or NIXL: it spawns
processes and speaks HTTP.
"""

from kvstage.serving.client import Result, complete, metric_total, served_model
from kvstage.serving.cluster import (
    CONNECTORS,
    FAILURE_POLICIES,
    TINY_CPU_ENGINE_ARGS,
    EngineArgs,
    PDCluster,
    single_instance,
)
from kvstage.serving.instances import Instance, ServingError

__all__ = [
    "CONNECTORS", "FAILURE_POLICIES", "TINY_CPU_ENGINE_ARGS", "EngineArgs", "Instance",
    "PDCluster", "Result", "ServingError", "complete", "metric_total", "served_model",
    "single_instance",
]
