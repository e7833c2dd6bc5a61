"""A small concurrent client for an OpenAI-compatible /v1/completions (router or api_server).

Contract:
- `complete` sends every prompt (token ids) as its own greedy request (temperature 0,
  ``return_token_ids``, vLLM >= 0.32) with at most ``concurrency`` in flight (threads, one
  blocking HTTP call each), and returns one `Result` per prompt, in prompt order: the
  generated token ids, or the error (HTTP status and body, or the exception) when the
  request failed. It never raises for a failed request; every call is bounded by
  ``timeout`` seconds (socket timeout per request, plus a bound on the whole batch).
- `metric_total` sums one Prometheus counter from ``GET /metrics`` (vLLM's exposition).
Response bodies are capped at `MAX_BODY_BYTES`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from kvstage.serving.instances import ServingError, http_get

MAX_BODY_BYTES = 16 << 20


@dataclass(frozen=True)
class Result:
    """One request: ``token_ids`` when it completed, else ``error`` (never both)."""

    token_ids: list[int] | None
    error: str | None = None
    finish_reason: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model id ``GET /v1/models`` lists."""
    status, body = http_get(url + "/v1/models", timeout=timeout)
    if status != 200:
        raise ServingError(f"GET {url}/v1/models answered {status}: {body[:300]!r}")
    return str(json.loads(body)["data"][0]["id"])


def complete_one(url: str, prompt: list[int], *, model: str, max_tokens: int,
                 timeout: float, ignore_eos: bool = True,
                 extra: dict[str, Any] | None = None) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": ignore_eos, **(extra or {})}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (http only)
            data = json.loads(resp.read(MAX_BODY_BYTES))
    except urllib.error.HTTPError as exc:
        text = exc.read(2000).decode(errors="replace")
        return Result(None, f"HTTP {exc.code}: {text}", seconds=time.perf_counter() - start)
    except (OSError, ValueError) as exc:
        return Result(None, f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    try:
        choice = data["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        return Result(None, f"malformed response ({exc!r}): {str(data)[:500]}", seconds=seconds)
    return Result(ids, finish_reason=choice.get("finish_reason"), seconds=seconds)


def complete(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int = 8,
             timeout: float = 120.0, *, model: str | None = None, ignore_eos: bool = True,
             extra: dict[str, Any] | None = None) -> list[Result]:
    """Greedy completions of ``prompts`` (token ids), ``concurrency`` at a time."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    name = model or served_model(url)
    batch_bound = timeout * (len(prompts) // concurrency + 2)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(complete_one, url, p, model=name, max_tokens=max_tokens,
                               timeout=timeout, ignore_eos=ignore_eos, extra=extra)
                   for p in prompts]
        done, pending = wait(futures, timeout=batch_bound)
        if pending:  # cannot happen with socket timeouts, but never wait unbounded
            for f in pending:
                f.cancel()
            raise ServingError(f"{len(pending)} requests still running after {batch_bound} s")
    return [f.result() for f in futures]


def _metrics_lines(url: str, timeout: float) -> list[str]:
    status, body = http_get(url + "/metrics", timeout=timeout)
    if status != 200:
        raise ServingError(f"GET {url}/metrics answered {status}")
    return body.decode(errors="replace").splitlines()


def metric_total(url: str, name: str, timeout: float = 10.0) -> float:
    """The sum of every sample of ``name`` (all label sets) in ``GET <url>/metrics``."""
    total = 0.0
    for line in _metrics_lines(url, timeout):
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_by_label(url: str, name: str, label: str, timeout: float = 10.0) -> dict[str, float]:
    """Every sample of ``name`` in ``GET <url>/metrics`` summed by its ``label``'s value."""
    out: dict[str, float] = {}
    for line in _metrics_lines(url, timeout):
        if not line.startswith(name + "{"):
            continue
        labels, value = line[len(name) + 1:].rsplit("} ", 1)
        for pair in labels.split(","):
            key, _, quoted = pair.partition("=")
            if key == label:
                out[quoted.strip('"')] = out.get(quoted.strip('"'), 0.0) + float(value)
    return out
