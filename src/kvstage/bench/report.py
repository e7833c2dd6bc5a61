"""Benchmark output helpers shared by ``kvstage bench copy`` and the programs of the
repository's bench/ folder (which import this module; the package never imports them).

Nothing here knows about copies or transfers: rows are plain dicts, a table is a list
of `Column`, JSON is ``{"config", "env", **sections}``. matplotlib is imported only
inside `plot_lines` (with the Agg backend) so a headless run without it still works.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Column:
    """One table column: ``key`` into the row, a header, and how to format the value."""

    key: str
    header: str = ""
    fmt: Callable[[Any], str] | str = "{}"
    align: str = ">"  # ">" right (numbers), "<" left (labels)

    def render(self, row: Row) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        if callable(self.fmt):
            return self.fmt(value)
        return self.fmt.format(value)


def format_bytes(n: float) -> str:
    """Binary units, 3 significant digits: 524288 -> '512 KiB', 11632640 -> '11.1 MiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            text = f"{value:.3g}" if unit != "B" else f"{value:.0f}"
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_table(
    rows: Sequence[Row], columns: Sequence[Column], *, title: str = "", markdown: bool = False
) -> str:
    """A fixed-width text table (or a GitHub markdown table, for BENCHMARKS.md)."""
    headers = [c.header or c.key for c in columns]
    cells = [[c.render(r) for c in columns] for r in rows]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [f"{v:{c.align}{w}}" for v, c, w in zip(values, columns, widths, strict=True)]
        return ("| " + " | ".join(parts) + " |") if markdown else "  ".join(parts)

    out = [f"**{title}**\n" if markdown else title] if title else []
    out.append(line(headers))
    if markdown:
        out.append("|" + "|".join(("-" * (w + 1) + ":") if c.align == ">" else "-" * (w + 2)
                                  for c, w in zip(columns, widths, strict=True)) + "|")
    else:
        out.append("  ".join("-" * w for w in widths))
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def print_table(
    rows: Sequence[Row], columns: Sequence[Column], *, title: str = "", markdown: bool = False
) -> None:
    print(format_table(rows, columns, title=title, markdown=markdown), flush=True)
    print(flush=True)


def pivot(
    rows: Iterable[Row], keys: Sequence[str], col: str, value: Callable[[Row], Any]
) -> list[dict[str, Any]]:
    """Long rows -> wide rows: one per distinct ``keys``, one column per ``row[col]``."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        k = tuple(r.get(x) for x in keys)
        out.setdefault(k, {x: r.get(x) for x in keys})[r[col]] = value(r)
    return list(out.values())


def summarize_ns(samples_ns: Sequence[int]) -> dict[str, float]:
    """min / median / mean in microseconds of per-iteration nanosecond timings."""
    if not samples_ns:
        raise ValueError("no timing samples: run at least one iteration (--iters >= 1)")
    return {
        "min_us": min(samples_ns) / 1e3,
        "median_us": statistics.median(samples_ns) / 1e3,
        "mean_us": statistics.fmean(samples_ns) / 1e3,
        "samples": len(samples_ns),
    }


Timer = Callable[[Callable[[], Any]], int]


def make_timer(*, cuda: bool) -> Timer:
    """Nanoseconds of one call: perf_counter_ns, or on CUDA a pair of events and one
    synchronize per call (the latency a caller waiting on the result sees)."""
    if not cuda:
        def wall(fn: Callable[[], Any]) -> int:
            t0 = time.perf_counter_ns()
            fn()
            return time.perf_counter_ns() - t0
        return wall
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def events(fn: Callable[[], Any]) -> int:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return int(start.elapsed_time(end) * 1e6)  # ms -> ns
    return events


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], timers: Mapping[str, Timer], *, warmup: int,
    iters: int, seed: int = 0,
) -> dict[str, list[int]]:
    """``warmup`` + ``iters`` rounds, every function once per round; the first ``warmup``
    rounds are dropped. Interleaving makes a noisy, shared machine slow every function
    alike. Each round runs in a fresh (seeded) random order: on a CPU a function pays
    for the cache state its predecessor left (cold code and data after a large copy),
    and any fixed cyclic order, rotated or not, would give it the same predecessor in
    every round."""
    names = list(fns)
    samples: dict[str, list[int]] = {name: [] for name in names}
    rng = random.Random(seed)
    gc_was = gc.isenabled()
    gc.disable()  # a collection inside one function's sample would bias it
    try:
        for it in range(warmup + iters):
            order = rng.sample(names, len(names))
            for name in order:
                ns = timers[name](fns[name])
                if it >= warmup:
                    samples[name].append(ns)
    finally:
        if gc_was:
            gc.enable()
    return samples


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for text in f:
                if text.startswith("model name"):
                    return text.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Who measured: torch version, device, CPU, cores, load (timings on a shared box
    are only comparable within one run), and the GPU when ``device`` is CUDA."""
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "value") and isinstance(value.value, (str, int)):  # enums
        return value.value
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    return str(value)


def write_json(
    path: str | os.PathLike[str], *, config: Mapping[str, Any], env: Mapping[str, Any],
    **sections: Any,
) -> Path:
    """Write ``{"config": ..., "env": ..., **sections}``; private keys (``_x``) of the
    config are dropped (argparse defaults such as the runner function)."""
    doc = {
        "config": {k: v for k, v in config.items() if not k.startswith("_")},
        "env": dict(env),
        **sections,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(doc), indent=2) + "\n", encoding="utf-8")
    return out


def plot_lines(
    path: str | os.PathLike[str],
    panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logy: bool = False,
) -> Path:
    """One subplot per panel, one line per series: ``{panel: {series: (xs, ys)}}``."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.0), squeeze=False, sharey=True)
    for ax, (name, series) in zip(axes[0], panels.items(), strict=False):
        for label, (xs, ys) in series.items():
            ax.plot(list(xs), list(ys), marker="o", label=label)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        if logy:
            ax.set_yscale("log")
        ax.legend(fontsize="small")
    axes[0][0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


class Progress:
    """Progress lines on stderr (``[3/12 1.4s] 16L 3G h2d``), so stdout stays the tables."""

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self.total = total
        self.done = 0
        self.enabled = enabled
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            elapsed = time.perf_counter() - self.start
            print(f"[{self.done}/{self.total} {elapsed:5.1f}s] {label}", file=sys.stderr,
                  flush=True)


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def profiler_counts(fn: Callable[[], Any], *, cuda: bool = False) -> Counter[str]:
    """Run ``fn`` once under torch.profiler and count what it issued.

    CPU side: outermost ``aten::`` ops only (``aten::index_put_`` counts, its inner
    ``aten::_index_put_impl_`` does not), keyed without the prefix, which is what a
    TorchDispatchMode such as kvstage's OpCounter sees. CUDA side (``cuda=True``): one
    key per memcpy kind as the profiler names it (``Memcpy HtoD (Pinned -> Device)``),
    plus ``CUDA kernels`` for every other device activity.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _drop_stderr_lines("profiler_start", "profiler_stop"), profile(
        activities=activities
    ) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    counts: Counter[str] = Counter()
    for ev in prof.events():
        if "CUDA" in str(getattr(ev, "device_type", "")):
            name = ev.name if ev.name.startswith(("Memcpy", "Memset")) else "CUDA kernels"
            counts[name] += 1
        elif ev.name.startswith("aten::") and not _has_aten_ancestor(ev):
            counts[ev.name.removeprefix("aten::")] += 1
    return counts


@contextlib.contextmanager
def _drop_stderr_lines(*needles: str) -> Iterator[None]:
    """Capture file descriptor 2 and replay it without lines containing ``needles``.

    Some torch builds print a ``USDT ... profiler_start`` line from C++ on every
    profiler start/stop (dozens per run, interleaved with progress); everything else
    the profiler writes (warnings, CUPTI errors) is passed through unchanged.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for raw in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not any(n in raw for n in needles):
                    sys.stderr.write(raw)
            sys.stderr.flush()


def _has_aten_ancestor(ev: Any) -> bool:
    parent = getattr(ev, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = getattr(parent, "cpu_parent", None)
    return False


def cuda_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak bytes the CUDA caching allocator handed out above its level before ``fn``."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)
