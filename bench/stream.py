"""A streamed /v1/completions call timed chunk by chunk (for pd_time and step_cost).

`post(url, body)`: the open HTTP response of one POST (RuntimeError, one line, unless 200).
`stream_times(url, body, start)`: ``perf_counter() - start`` of every ``data: {...}`` chunk
of a streamed completion (the first is the client's TTFT, the gaps its inter-token
latencies: vLLM streams one chunk per generated token), then of the last byte.
Every socket operation is bounded by `TIMEOUT_S`.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from typing import Any

TIMEOUT_S = 120.0


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
