"""bench.serving_netns's pure parts, without root or vLLM: its arguments (``--lens``,
``--variant``, the checks after parsing), the engine settings and prompts it derives, and
the summary table of a fixed result document."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from bench import serving_netns as sn
from kvstage.cli import program_parser

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return program_parser(sn, "python -m bench.serving_netns").parse_args(list(argv))


def test_imports_nothing_from_vllm() -> None:
    code = ("import sys, bench.serving_netns; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'nixl', "
            "'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_lens() -> None:
    assert sn.parse_lens("2000-4000") == (2000, 4000)
    assert sn.parse_lens("3000") == (3000, 3000)
    for bad in ("4000-2000", "0-10", "a-b", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="MIN-MAX"):
            sn.parse_lens(bad)


def test_variants_and_defaults() -> None:
    args = parse("--variant", "before:UCX_TCP_TX_SEG_SIZE=8k,UCX_TCP_RX_SEG_SIZE=64k",
                 "--variant", "after:", "--rounds", "2", "--lens", "100-200")
    assert args.variant == [("before", {"UCX_TCP_TX_SEG_SIZE": "8k",
                                        "UCX_TCP_RX_SEG_SIZE": "64k"}), ("after", {})]
    assert (args.rounds, args.lens, args.prompts, args.concurrency) == (2, (100, 200), 8, 4)
    sn.check(args)
    with pytest.raises(SystemExit):
        parse("--variant", "x:NOEQUALS")
    with pytest.raises(SystemExit):
        parse("--variant", ":A=1")
    with pytest.raises(argparse.ArgumentTypeError, match="--concurrency 9"):
        sn.check(parse("--concurrency", "9"))
    with pytest.raises(argparse.ArgumentTypeError, match="--kv-heads 3"):
        sn.check(parse("--kv-heads", "3"))


def test_engine_args_and_prompts() -> None:
    args = parse("--lens", "2000-4000", "--max-tokens", "4", "--concurrency", "4")
    assert sn.kv_bytes_per_token(args) == 4 * 2 * 8 * 64 * 4  # 16 KiB per token
    engine = sn.engine_args(args)
    assert engine.max_model_len == 4032  # 4004 tokens, whole blocks of 32
    assert engine.kv_cache_memory_bytes == 8 * 4032 * 16384  # 8 of the longest requests
    assert engine.dtype == "float32" and engine.block_size == 32
    prompts = sn.make_prompts(args)
    assert prompts == sn.make_prompts(args)  # a fixed seed
    assert len(prompts) == 8 and all(2000 <= len(p) <= 4000 for p in prompts)
    assert all(4 <= t < 512 for p in prompts for t in p)


def _run(variant: str, ttfts: list[float], reads: list[float], ids: list[list[int]],
         read4: float) -> dict:
    serial = [{"ttft_s": t, "ids": i, "error": None, "read_s": r, "reads": 1.0,
               "read_bytes": 3 * 2**20, "h2d_s": r, "d2h_wait_s": 0.0}
              for t, r, i in zip(ttfts, reads, ids, strict=True)]
    both = [{"ttft_s": 2 * t, "ids": i, "error": None} for t, i in zip(ttfts, ids, strict=True)]
    return {"variant": variant, "serial": serial, "concurrent": both, "wall_s": 1.0,
            "concurrent_metrics": {"read_s": read4, "reads": 2.0, "read_bytes": 6 * 2**20}}


DOC = {
    "config": {"concurrency": 2},
    "prompts": [[5] * 100, [6] * 300],
    "reference": [[1, 2], [3, 4]],
    "runs": [
        _run("before", [1.0, 2.0], [0.1, 0.2], [[1, 2], [3, 4]], 0.6),
        _run("after", [0.5, 1.5], [0.05, 0.05], [[1, 2], [9, 9]], 0.2),
    ],
}


def test_summary_rows() -> None:
    before, after = sn.summarize(DOC)
    assert before == {
        "variant": "before", "rounds": 1, "prompts": 2, "tokens": 200.0, "kv_mib": 3.0,
        "ttft1_ms": pytest.approx(1500.0), "ttft4_ms": pytest.approx(3000.0),
        "read1_ms": pytest.approx(150.0), "share1": pytest.approx(10.0),
        "read4_ms": pytest.approx(300.0), "share4": pytest.approx(10.0),
        "exact": 4, "total": 4, "answered": 4}
    assert after["exact"] == 2  # the second prompt differs in both phases
    assert after["share1"] == pytest.approx(5.0)


def test_summary_table() -> None:
    lines = sn.format_summary(DOC).splitlines()
    assert "TTFT p50, 2 in flight (ms)" in lines[0]
    assert lines[2].replace(" ", "").split("|")[1:-1] == [
        "before", "1", "2", "200", "3.0", "1500", "3000", "150.0", "10.0%", "300.0",
        "10.0%", "4/4"]
    assert lines[3].replace(" ", "").endswith("|2/4|")
