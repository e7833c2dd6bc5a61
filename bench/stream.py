"""What the benches against api_servers share: a streamed /v1/completions call timed chunk
by chunk, the client's placement, the output files.

`post(url, body)`: the open HTTP response of one POST (RuntimeError, one line, unless 200).
`stream_times(url, body, start)`: ``perf_counter() - start`` of every ``data: {...}`` chunk
of a streamed completion (the first is the client's TTFT, the gaps its inter-token
latencies: vLLM streams one chunk per generated token), then of the last byte.
`first_and_gaps(url, body, start)`: that TTFT and those gaps.
Every socket operation is bounded by `TIMEOUT_S`.
`client_off(core)`: this process off ``core`` (the servers' one), when it has others.
`SETTLE_S` / `add_settle(parser)`: the pause before each request of an A/B between servers
sharing a core. vLLM's worker busy-loops (``sched_yield``) for 1 s after its last step
(``SpinCondition.busy_loop_s``), and each server is its own session, so with the kernel's
autogroup scheduling a server still spinning takes a fair share of the core from the next
one measured: back to back, which server follows which biases the ratios.
`begin(args, build, name)`: a bench's start: ``args.out`` made, its model built under
``<out>/models/<name>`` (``build``; default the tiny Llama), the generator seeded with
``args.seed`` and the start time `write_results` reports; SIGTERM exits through the
bench's ``finally`` (a killed bench stops its api_servers).
`add_kv_extra(parser)` / `kv_extra(parser, args)`: ``--kv-extra KEY=VALUE`` for the
kvstage instances, checked as the connector checks it.
`write_results(out, stem, text, args, started, payload)`: ``<out>/<stem>.md`` (``text``)
and ``<out>/<stem>.json`` (``payload`` and a ``meta`` of argv, args and wall seconds).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TIMEOUT_S = 120.0
SETTLE_S = 1.5  # over vLLM's 1 s busy loop after a worker's last step


def add_settle(p: argparse.ArgumentParser) -> None:
    """``--settle-s`` (default `SETTLE_S`; 0: back to back), checked in [0, 10]."""
    def seconds(text: str) -> float:
        value = float(text)
        if not 0 <= value <= 10:
            raise argparse.ArgumentTypeError(f"expected seconds in [0, 10], got {text}")
        return value

    p.add_argument("--settle-s", type=seconds, default=SETTLE_S,
                   help="idle seconds before each request: a server that just served "
                   "busy-loops for 1 s and takes a share of the core from the next one "
                   "(bench.stream)")


def add_kv_extra(p: argparse.ArgumentParser) -> None:
    """``--kv-extra KEY=VALUE`` (repeatable): kv_connector_extra_config of the kvstage
    instances; `kv_extra` checks it."""
    from kvstage.cli.serve_pd import _kv_extra

    p.add_argument("--kv-extra", type=_kv_extra, action="append", default=[],
                   metavar="KEY=VALUE", help="kv_connector_extra_config entry of the kvstage "
                   "instances (VALUE read as JSON if it parses, as serve-pd's); repeatable")


def kv_extra(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """``--kv-extra`` as a dict, checked as the connector checks it (a bad value: one line,
    exit 2, before any server starts)."""
    from kvstage.integrations.vllm.config import KVStageConfig

    extra: dict[str, Any] = dict(args.kv_extra)
    try:
        KVStageConfig.parse(extra)
    except ValueError as e:
        p.error("--kv-extra: " + "; ".join(str(e).splitlines()))
    return extra


def post(url: str, body: dict[str, Any]) -> http.client.HTTPResponse:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.netloc, timeout=TIMEOUT_S)  # "host:port"
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"POST {url} answered {resp.status}: {resp.read(500)!r}")
    return resp


def stream_times(url: str, body: dict[str, Any], start: float) -> tuple[list[float], float]:
    """(seconds to each token chunk, seconds to the last byte); see the module doc."""
    resp = post(url, {**body, "stream": True})
    chunks: list[float] = []
    for raw in resp:
        if raw.strip().startswith(b"data: {"):
            chunks.append(time.perf_counter() - start)
    end = time.perf_counter() - start
    resp.close()
    if not chunks:
        raise RuntimeError(f"{url}: a stream without a token")
    return chunks, end


def first_and_gaps(url: str, body: dict[str, Any], start: float | None = None
                   ) -> tuple[float, list[float]]:
    """TTFT (from ``start``, default now) and the gaps between streamed tokens."""
    chunks, _ = stream_times(url, body, time.perf_counter() if start is None else start)
    return chunks[0], [float(g) for g in np.diff(chunks)]


def client_off(core: int) -> None:
    """Run this process off ``core`` (the servers'): its own CPU is not what is measured."""
    others = os.sched_getaffinity(0) - {core}
    if others:
        os.sched_setaffinity(0, others)


def begin(args: argparse.Namespace, build: Callable[[Path], Path] | None = None,
          name: str = "tiny-llama") -> tuple[Path, str, np.random.Generator, float]:
    """(out, model path, seeded generator, start time) for a bench run; see the module doc.
    SIGTERM then exits through the bench's ``finally`` blocks (its servers stopped)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if build is None:
        from kvstage.testing.tiny_llama import build_tiny_llama

        build = build_tiny_llama
    model = str(build(out / "models" / name))
    return out, model, np.random.default_rng(args.seed), time.monotonic()


def write_results(out: Path, stem: str, text: str, args: argparse.Namespace, started: float,
                  payload: dict[str, Any], **extra: Any) -> None:
    meta = {"argv": sys.argv, "args": vars(args), **extra,
            "wall_s": round(time.monotonic() - started)}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, **payload}, indent=1))
    (out / f"{stem}.md").write_text(text)
