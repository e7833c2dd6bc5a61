"""Real vLLM engines in child processes, for kvstage's tests and benches (CPU, 127.0.0.1).

Contract:
- `VLLMEngine(spec)` starts ``python -m kvstage.testing.vllm_engines`` in its own process
  group with one offline ``vllm.LLM`` inside (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine
  core and worker live in that one process, so killing it leaves nothing behind).
- ``tensor_parallel_size > 1``: the engine core stays in that process and vLLM's
  multiprocessing executor (``distributed_executor_backend="mp"``) forks one worker per rank,
  each bound to its own core(s) (``VLLM_CPU_OMP_THREADS_BIND`` = `EngineSpec.omp_threads_bind`,
  e.g. ``"0|1"``), or left to the kernel (``bind_cores=False``: ``"nobind"``). The workers
  stay in the engine's process group, so `stop` and `kill` reach them too. Idle CPU
  workers spin-wait: an idle TP engine keeps its cores busy.
- Requests go in as JSON lines on the child's stdin; results come back as JSON lines on a
  dedicated pipe (vLLM's own prints go to the log file, never into the protocol).
- `held` steps the engine core a bounded number of times and reports the requests a
  prefill still holds for remote decodes and the free block count: the exact observable
  for "a notification freed (or did not free) a request's blocks".
- Every wait is bounded: `start` and `generate` take a timeout and raise `EngineError`
  (with the log's tail) when it passes or when the child dies. `stop` kills the process
  group (SIGTERM, then SIGKILL after a grace period); `kill` is SIGKILL at once, for fault
  tests. The parent never imports vLLM.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstage.serving.kv_config import (  # noqa: F401  (re-exported for tests, benches)
    KVSTAGE_CONNECTOR,
    VLLM_HOST_PATH_CONNECTOR,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)


class EngineError(RuntimeError):
    """The engine child died, refused to start, or did not answer in time."""


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """One engine: the model directory and the knobs the tests vary."""

    model: str
    log_path: str
    kv_transfer_config: dict[str, Any] | None = None
    max_model_len: int = 512
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    # vLLM's CPU attention aligns the tiny Gemma3's blocks to 32; None: vLLM picks (state
    # hybrids: it grows the attention block until a page holds a state slot)
    block_size: int | None = 32
    kv_cache_bytes: int = 64 << 20  # the KV pool (8192 blocks of the tiny model)
    cpu_core: int = 0  # tensor_parallel_size 1: the one core (cpu_cores: None)
    dtype: str = "float32"
    env: dict[str, str] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    # one core per rank (rank r on cpu_cores[r]); None: cpu_core, cpu_core + 1, ...
    cpu_cores: tuple[int, ...] | None = None
    # False: the ranks are left to the kernel ("nobind"), as serve-pd leaves instances whose
    # ranks outnumber the cores (`kvstage.serving.placement.place_ranks`)
    bind_cores: bool = True

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} < 1")
        if self.cpu_cores is not None:
            cores = tuple(int(c) for c in self.cpu_cores)  # a list, after a JSON round trip
            if len(cores) != self.tensor_parallel_size:
                raise ValueError(f"cpu_cores {cores} names {len(cores)} cores for "
                                 f"tensor_parallel_size {self.tensor_parallel_size}")
            object.__setattr__(self, "cpu_cores", cores)

    def omp_threads_bind(self) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND``: the ranks' cores, ``|``-separated ("0|1"), or
        "nobind" (``bind_cores`` False)."""
        if not self.bind_cores:
            return "nobind"
        if self.cpu_cores is None:
            if self.tensor_parallel_size == 1:
                return str(self.cpu_core)
            return "|".join(str(self.cpu_core + r) for r in range(self.tensor_parallel_size))
        return "|".join(str(c) for c in self.cpu_cores)


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One request's result. ``logprobs[i]`` maps token id -> logprob at output step i."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None


@dataclass(frozen=True)
class HeldState:
    """What a prefill engine holds for remote decodes (`VLLMEngine.held`)."""

    request_ids: list[str]  # finished requests whose blocks wait for a decode's READ
    free_blocks: int  # the block pool's free blocks (vLLM's BlockPool.get_num_free_blocks)


class VLLMEngine:
    """A vLLM engine in a child process; use as a context manager."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._proc: subprocess.Popen[bytes] | None = None
        self._results: int | None = None
        self._buf = b""
        #: wall seconds of the last ``LLM.generate`` call, measured in the child
        self.last_generate_s = float("nan")

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 240.0) -> VLLMEngine:
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_OMP_THREADS_BIND=self.spec.omp_threads_bind(),
            OMP_NUM_THREADS="1",
            UCX_NET_DEVICES="lo",
            VLLM_HOST_IP="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            KVSTAGE_ENGINE_RESULT_FD=str(write_fd),
        )
        env.update(self.spec.env)
        log = open(self.spec.log_path, "ab")  # noqa: SIM115 (closed right after Popen)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, json.dumps(asdict(self.spec))],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        finally:
            log.close()
            os.close(write_fd)
        self._results = read_fd
        self._read_message(timeout, expect="ready")
        return self

    @property
    def pid(self) -> int:
        assert self._proc is not None, "engine not started"
        return self._proc.pid

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_tokens: int,
        logprobs: int = 5,
        kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
        timeout: float = 240.0,
    ) -> list[Completion]:
        """Greedy generation of every prompt in one ``LLM.generate`` call."""
        assert self._proc is not None and self._proc.stdin is not None, "engine not started"
        params = list(kv_transfer_params or [None] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} kv_transfer_params")
        request = {"prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs,
                   "kv_transfer_params": params}
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        message = self._read_message(timeout, expect="results")
        self.last_generate_s = float(message["seconds"])
        return [
            Completion(
                token_ids=r["token_ids"],
                logprobs=[{int(k): v for k, v in step.items()} for step in r["logprobs"]],
                kv_transfer_params=r["kv_transfer_params"],
                finish_reason=r["finish_reason"],
            )
            for r in message["results"]
        ]

    def held(self, *, steps: int = 20, interval_s: float = 0.05,
             timeout: float = 60.0) -> HeldState:
        """Step the engine ``steps`` times, ``interval_s`` apart (so NIXL notifications that
        arrived are processed, as vLLM's busy loop would), then report what it still holds
        for remote decodes: the ids of finished requests whose blocks are not freed yet,
        and the block pool's free block count."""
        assert self._proc is not None and self._proc.stdin is not None, "engine not started"
        request = {"op": "held", "steps": steps, "interval_s": interval_s}
        self._proc.stdin.write(json.dumps(request).encode() + b"\n")
        self._proc.stdin.flush()
        message = self._read_message(timeout, expect="held")
        return HeldState(request_ids=message["request_ids"],
                         free_blocks=message["free_blocks"])

    def op(self, name: str, timeout: float = 60.0, **payload: Any) -> dict[str, Any]:
        """One `vllm_engine_ops` op (``submit``, ``step``, ``abort``): its reply message."""
        assert self._proc is not None and self._proc.stdin is not None, "engine not started"
        self._proc.stdin.write(json.dumps({"op": name, **payload}).encode() + b"\n")
        self._proc.stdin.flush()
        return self._read_message(timeout, expect=name)

    def kill(self) -> None:
        """SIGKILL the whole process group now (a crash, for fault tests)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=30)
            _wait_group_gone(self._proc.pid, grace=30.0)

    def stop(self, grace: float = 15.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        _wait_group_gone(self._proc.pid, grace=grace)  # TP workers outlive the engine a bit
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        if self._results is not None:
            os.close(self._results)
            self._results = None
        self._proc = None

    def log_tail(self, num_bytes: int = 6000) -> str:
        try:
            data = Path(self.spec.log_path).read_bytes()
        except OSError:
            return ""
        return data[-num_bytes:].decode(errors="replace")

    def _read_message(self, timeout: float, *, expect: str) -> dict[str, Any]:
        assert self._proc is not None and self._results is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self._results, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(
                        f"no {expect!r} from the engine within {timeout:.0f} s; "
                        f"log tail:\n{self.log_tail()}"
                    )
                if sel.select(timeout=min(left, 1.0)):
                    chunk = os.read(self._results, 1 << 20)
                    if not chunk:
                        raise EngineError(
                            f"engine exited (rc={self._proc.poll()}) before {expect!r}; "
                            f"log tail:\n{self.log_tail()}"
                        )
                    self._buf += chunk
                elif self._proc.poll() is not None:
                    raise EngineError(
                        f"engine exited (rc={self._proc.returncode}) before {expect!r}; "
                        f"log tail:\n{self.log_tail()}"
                    )
        line, _, self._buf = self._buf.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        if message.get("error"):
            raise EngineError(f"engine failed: {message['error']}")
        if message.get("kind") != expect:
            raise EngineError(f"expected {expect!r} from the engine, got {message!r}")
        return message


def _wait_group_gone(pgid: int, grace: float) -> None:
    """Wait until no process of group ``pgid`` is left (SIGKILL them after ``grace``)."""
    deadline = time.monotonic() + grace
    killed = False
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            if killed:
                raise EngineError(f"processes of group {pgid} survived SIGKILL")
            os.killpg(pgid, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + 30.0
        time.sleep(0.05)


def _serve(spec: EngineSpec) -> None:  # runs in the child: the only vLLM import here
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvstage.testing import vllm_engine_ops

    out = os.fdopen(int(os.environ["KVSTAGE_ENGINE_RESULT_FD"]), "w", buffering=1)

    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")

    engine_args: dict[str, Any] = {
        "model": spec.model,
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        "max_num_seqs": spec.max_num_seqs,
        "enable_prefix_caching": False,
        "seed": 0,
        "kv_cache_memory_bytes": spec.kv_cache_bytes,
    }
    if spec.block_size is not None:
        engine_args["block_size"] = spec.block_size
    if spec.kv_transfer_config is not None:
        engine_args["kv_transfer_config"] = spec.kv_transfer_config
    if spec.tensor_parallel_size > 1:  # worker processes (the engine core stays in-process)
        engine_args["tensor_parallel_size"] = spec.tensor_parallel_size
        engine_args["distributed_executor_backend"] = "mp"
    llm = LLM(**engine_args)
    send({"kind": "ready"})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "held":
            send(vllm_engine_ops.held(llm, request["steps"], request["interval_s"]))
            continue
        if request.get("op") in vllm_engine_ops.OPS:  # async requests (fault tests)
            try:
                send(vllm_engine_ops.run_op(llm, request))
            except Exception as e:  # report it to the parent, then keep serving
                send({"kind": request["op"], "error": f"{type(e).__name__}: {e}"})
            continue
        try:
            prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
            params = [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=request["max_tokens"],
                    logprobs=request["logprobs"],
                    detokenize=False,
                    extra_args={"kv_transfer_params": kv} if kv is not None else None,
                )
                for kv in request["kv_transfer_params"]
            ]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        except Exception as e:  # report it to the parent, then keep serving
            send({"kind": "results", "error": f"{type(e).__name__}: {e}"})
            continue
        results = []
        for o in outputs:
            c = o.outputs[0]
            steps = [{str(k): v.logprob for k, v in step.items()} for step in (c.logprobs or [])]
            results.append({
                "token_ids": list(c.token_ids),
                "logprobs": steps,
                "kv_transfer_params": o.kv_transfer_params,
                "finish_reason": c.finish_reason,
            })
        send({"kind": "results", "results": results, "seconds": seconds})


if __name__ == "__main__":
    _serve(EngineSpec(**json.loads(sys.argv[1])))


# What a proxy sends the prefill instance: "decode happens elsewhere, keep the blocks".
PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
