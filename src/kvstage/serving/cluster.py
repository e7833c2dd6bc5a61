"""A P/D deployment as vLLM users run it: N prefill + M decode api_servers and vllm-router.

Contract:
- `PDCluster` builds the command lines (`api_server_argv`, `router_argv`), starts every
  api_server (``python -m vllm.entrypoints.openai.api_server``, the server `vllm serve`
  runs) on 127.0.0.1 with its own HTTP port and NIXL side-channel port, waits for each
  /health, then starts `vllm-router` in P/D mode in front. Exiting the context (or `stop`)
  stops the router first, then every api_server, each by process group (`Instance.stop`).
  A start that fails stops whatever it had started and raises `ServingError` with the log.
- CPU (``device="cpu"``): cores of this process's affinity are split between instances
  (`placement.place_ranks`; on 2 cores at TP 1 prefills share core 0, decodes core 1),
  each pinned with ``taskset`` and its ranks with vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
  (left to the kernel where ranks outnumber cores); ``kv_buffer_device: cpu``.
  CUDA (``device="cuda"``):
  each api_server gets one GPU of ``CUDA_VISIBLE_DEVICES`` (distinct while they last); the
  host path is vLLM's own there (``kv_buffer_device: cpu``), nothing forced.
- ``connector``: "kvstage" (KVStageConnector), "nixl" (vLLM's NixlConnector; on CPU its
  host path via kvstage.testing.vllm_baseline, for comparisons only) or "none" (plain
  engines; `single_instance` is the one-engine case).
- No vLLM import: this module only spawns processes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstage.serving.engine_args import (  # noqa: F401  (re-exported)
    DEFAULT_ENGINE_ARGS,
    TINY_CPU_ENGINE_ARGS,
    EngineArgs,
)
from kvstage.serving.instances import Instance, ServingError
from kvstage.serving.kv_config import (
    KVSTAGE_CONNECTOR,
    VLLM_HOST_PATH_CONNECTOR,
    free_ports,
    is_loopback,
    kv_transfer_config,
    side_channel_env,
)
from kvstage.serving.placement import gpu_assignment, omp_threads_bind, place_ranks

CONNECTORS = ("kvstage", "nixl", "none")
FAILURE_POLICIES = ("fail", "recompute")
DEVICES = ("cpu", "cuda")
MAX_TP = 64
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def connector_config(connector: str, role: str, *, device: str, policy: str,
                     extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of one instance (None for ``connector="none"``)."""
    if connector == "none":
        return None
    if device == "cpu":
        cls = KVSTAGE_CONNECTOR if connector == "kvstage" else VLLM_HOST_PATH_CONNECTOR
        cfg = kv_transfer_config(cls, role, **(extra or {}))
    else:
        # the host path on GPUs too: KV staged through pinned host memory (what kvstage is)
        cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        if connector == "kvstage":
            cfg["kv_connector"], cfg["kv_connector_module_path"] = KVSTAGE_CONNECTOR
        if extra:
            cfg["kv_connector_extra_config"] = dict(extra)
    cfg["kv_load_failure_policy"] = policy
    return cfg


def default_device() -> str:
    """"cuda" when an NVIDIA device node exists and CUDA_VISIBLE_DEVICES does not hide it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "cpu"
    return "cuda" if os.path.exists("/dev/nvidia0") else "cpu"


def across_hosts_ucx(host: str) -> dict[str, str]:
    """UCX for an instance peers reach at ``host``: `kvstage.transport.ucx_env.choose`'s
    env, as kvstage's own roles get it (TCP only: between two network namespaces of one
    machine UCX would take shared memory and no byte would cross the link; the interface
    that holds ``host``; larger TCP segments). Variables already in this environment keep
    their value; an address it cannot resolve gets the same minus the interface."""
    from kvstage.transport import ucx_env

    try:
        return ucx_env.choose(host).env
    except (OSError, ValueError):
        env = ucx_env.choose("0.0.0.0").env
        env.pop("UCX_NET_DEVICES", None)
        return env


def router_executable() -> str:
    """vllm-router next to this Python (its venv), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise ServingError("vllm-router not found next to this Python or on PATH; install it: "
                           "pip install vllm-router==0.1.17")
    return found


def api_server_instance(name: str, role: str, model: str, *, port: int, log_dir: Path,
                        engine_args: EngineArgs, kv_config: dict[str, Any] | None,
                        device: str, cores: tuple[int, ...] | None = None,
                        gpu: str | None = None, side_channel_port: int | None = None,
                        env: dict[str, str] | None = None, host: str = "127.0.0.1",
                        rank_cores: tuple[tuple[int, ...], ...] | None = None) -> Instance:
    """An api_server `Instance` (not started) bound to ``host`` (its HTTP server, NIXL side
    channel and ``VLLM_HOST_IP``); UCX on loopback only when ``host`` is loopback.
    ``rank_cores`` (CPU): the cores of each tensor-parallel rank (`place_ranks`); more than
    one rank runs the instance at that TP size (``gpu``, on CUDA: its GPUs, one per rank;
    its side channel takes ``side_channel_port`` + rank)."""
    tp = len(rank_cores) if rank_cores else (len(gpu.split(",")) if gpu else 1)
    argv = [sys.executable, "-m", API_SERVER_MODULE, "--model", model,
            "--host", host, "--port", str(port), *engine_args.argv()]
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if rank_cores is not None:
        cores = tuple(sorted({c for r in rank_cores for c in r}))
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
    # DS: the conv state (dim, state_len), which vLLM's NIXL transfer of Mamba state needs;
    # set on every instance (reference engines too: the same kernels), inert without Mamba
    child_env = {"VLLM_HOST_IP": host, "VLLM_NO_USAGE_STATS": "1",
                 "VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
    if side_channel_port is not None:
        child_env.update(side_channel_env(side_channel_port, host))
    unset: tuple[str, ...] = ()
    if device == "cpu":
        if cores:
            argv = ["taskset", "-c", ",".join(map(str, cores)), *argv]
            # vLLM's CPU workers: rank r's OpenMP threads on the r-th |-separated list, or
            # no binding where ranks share cores
            bind, threads = omp_threads_bind(rank_cores or (cores,))
            child_env["VLLM_CPU_OMP_THREADS_BIND"] = bind
            child_env["OMP_NUM_THREADS"] = str(threads)
        if is_loopback(host):
            child_env["UCX_NET_DEVICES"] = "lo"
    if not is_loopback(host):
        child_env.update(across_hosts_ucx(host))
        if engine_args.kv_cache_memory_bytes is not None:
            unset = ("VLLM_CPU_KVCACHE_SPACE",)  # it would override --kv-cache-memory-bytes
    elif gpu is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = gpu
    child_env.update(env or {})
    return Instance(name=name, role=role, argv=argv, port=port, env=child_env,
                    unset_env=unset, log_path=log_dir / f"{name}.log",
                    side_channel_port=side_channel_port, cores=cores, host=host)


def router_instance(prefills: list[Instance] | list[str], decodes: list[Instance] | list[str],
                    *, port: int, metrics_port: int, log_dir: Path,
                    policy: str = "round_robin", extra: tuple[str, ...] = (),
                    host: str = "127.0.0.1") -> Instance:
    """vllm-router in vLLM P/D mode (NIXL-style kv_transfer_params) in front of the
    instances (or their URLs), listening on ``host`` (its metrics on 127.0.0.1)."""
    argv = [router_executable(), "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for p in prefills:
        argv += ["--prefill", p if isinstance(p, str) else p.url]
    for d in decodes:
        argv += ["--decode", d if isinstance(d, str) else d.url]
    argv += ["--host", host, "--port", str(port), "--policy", policy,
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
             "--worker-startup-timeout-secs", "60", *extra]
    return Instance(name="router", role="router", argv=argv, port=port,
                    log_path=log_dir / "router.log", host=host)


@dataclass(kw_only=True)
class PDCluster:
    """N prefill + M decode api_servers behind vllm-router; a context manager."""

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1  # tensor-parallel size of each prefill instance
    decode_tp: int = 1
    connector: str = "kvstage"
    kv_load_failure_policy: str = "fail"
    log_dir: str | Path | None = None
    engine_args: EngineArgs = DEFAULT_ENGINE_ARGS
    extra_kv_config: dict[str, Any] | None = None
    env: dict[str, str] | None = None  # on top of each api_server's own
    device: str = field(default_factory=default_device)
    router_port: int | None = None
    router_policy: str = "round_robin"
    router_args: tuple[str, ...] = ()
    start_timeout: float = 300.0
    share_gpus: bool = False  # device cuda: allow fewer GPUs than instances
    prefills: list[Instance] = field(init=False, default_factory=list)
    decodes: list[Instance] = field(init=False, default_factory=list)
    router: Instance | None = field(init=False, default=None)
    _routers: list[Instance] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS[:2]:
            raise ValueError(f"connector must be one of {CONNECTORS[:2]} for P/D, "
                             f"got {self.connector!r} (single_instance is the plain engine)")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"need >= 1 prefill and >= 1 decode, got {self.num_prefill} "
                             f"and {self.num_decode}")
        if not (1 <= self.prefill_tp <= MAX_TP and 1 <= self.decode_tp <= MAX_TP):
            raise ValueError(f"tensor-parallel sizes must be 1..{MAX_TP}, got prefill "
                             f"{self.prefill_tp} and decode {self.decode_tp}")
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="kvstage-serve-")
        log_dir = Path(self.log_dir)
        n = self.num_prefill + self.num_decode
        tps = [self.prefill_tp] * self.num_prefill + [self.decode_tp] * self.num_decode
        http = free_ports(n)
        side = free_ports(n, width=max(tps))  # rank r listens on side + r
        cores = place_ranks(sorted(os.sched_getaffinity(0)), self.num_prefill,
                            self.num_decode, self.prefill_tp, self.decode_tp)
        gpus: list[str | None] = (list(gpu_assignment(n, share=self.share_gpus, tps=tps))
                                  if self.device == "cuda" else [None] * n)
        for i in range(n):
            role = "prefill" if i < self.num_prefill else "decode"
            index = i if role == "prefill" else i - self.num_prefill
            extra = dict(self.extra_kv_config or {})
            if self.connector == "kvstage" and self.prefill_tp != self.decode_tp:
                # each side cuts its pages for the other's TP size (kvstage.pd.tp_map)
                extra["kvstage_peer_tp_size"] = (self.decode_tp if role == "prefill"
                                                 else self.prefill_tp)
            kv = connector_config(self.connector,
                                  "kv_producer" if role == "prefill" else "kv_consumer",
                                  device=self.device, policy=self.kv_load_failure_policy,
                                  extra=extra or None)
            inst = api_server_instance(
                f"{role}{index}", role, self.model, port=http[i], log_dir=log_dir,
                engine_args=self.engine_args, kv_config=kv, device=self.device,
                rank_cores=cores[i], gpu=gpus[i],
                side_channel_port=side[i], env=self.env)
            (self.prefills if role == "prefill" else self.decodes).append(inst)

    @property
    def instances(self) -> list[Instance]:
        return [*self.prefills, *self.decodes]

    @property
    def router_url(self) -> str:
        if self.router is None:
            raise ServingError("the router is not started")
        return self.router.url

    def start(self) -> PDCluster:
        try:
            for inst in self.instances:  # spawn all, then wait: engines load in parallel
                inst.spawn()
            for inst in self.instances:
                inst.wait_ready(self.start_timeout)
            self.router = self.start_router(port=self.router_port)
        except BaseException:
            self.stop()
            raise
        return self

    def start_router(self, prefills: list[Instance] | None = None,
                     decodes: list[Instance] | None = None, *, port: int | None = None,
                     metrics_port: int | None = None, timeout: float = 90.0) -> Instance:
        """Start one more vllm-router over a subset of the instances (default: all), e.g.
        a 1P1D view of a 2P2D cluster; it stops with the cluster.

        Ports it picks itself are taken right before the start, and a router that exits
        before it is ready is started once more on fresh ones (seen once on this shared
        machine: rc 1 with nothing in its log, after its workers were found healthy)."""
        attempts = 1 if port is not None and metrics_port is not None else 2
        for attempt in range(attempts):
            ports = free_ports(2)
            router = router_instance(
                self.prefills if prefills is None else prefills,
                self.decodes if decodes is None else decodes,
                port=port or ports[0], metrics_port=metrics_port or ports[1],
                log_dir=Path(str(self.log_dir)), policy=self.router_policy,
                extra=self.router_args)
            router.name = f"router{len(self._routers)}" if self._routers else "router"
            router.log_path = router.log_path.with_name(f"{router.name}.log")
            self._routers.append(router)
            try:
                return router.start(timeout=timeout)
            except ServingError:
                if attempt + 1 == attempts:
                    raise
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Routers first (no new work), then every api_server; each bounded."""
        for inst in [*self._routers, *self.instances]:
            inst.stop()

    def __enter__(self) -> PDCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class single_instance:  # noqa: N801 (used like a function: `with single_instance(...) as s`)
    """One plain api_server (no connector), the reference the P/D output must equal."""

    def __init__(self, model: str, *, log_dir: str | Path | None = None,
                 engine_args: EngineArgs = DEFAULT_ENGINE_ARGS, device: str | None = None,
                 cores: tuple[int, ...] | None = None, port: int | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 300.0) -> None:
        log = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(
            prefix="kvstage-single-"))
        dev = device or default_device()
        self.start_timeout = start_timeout
        self.instance = api_server_instance(
            "single", "single", model, port=port or free_ports(1)[0], log_dir=log,
            engine_args=engine_args, kv_config=None, device=dev,
            cores=cores if cores is not None else (min(os.sched_getaffinity(0)),), env=env)

    def __enter__(self) -> Instance:
        try:
            return self.instance.start(self.start_timeout)
        except BaseException:
            self.instance.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.instance.stop()
