"""Careless input to the bench programs and role commands (issue 20 item 6): one stderr
line that names what was expected and what arrived, exit 2, no traceback, nothing allocated.

The allocation cases run ``kvstage`` (or ``python -m bench.X``) as a subprocess under an
address-space limit far below what the careless value would allocate (and far above what a
refusal needs), so an attempt to allocate shows up as a crash, never as a refusal by luck. The
``--pipeline`` defaults are proven through the same validation the bench runs first
(`pipeline.resolve`), without starting its processes.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import pipeline, transfer
from kvstage.blocks import request_blocks
from kvstage.cli import main as cli_main
from kvstage.cli import memory, program_parser
from kvstage.presets import preset

#: the subprocess's address space: torch and NIXL-free kvstage import in it, while the
#: smallest careless allocation below (the soak's 80 GiB) could not
ADDRESS_SPACE = 12 << 30


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


REPO = Path(__file__).resolve().parents[2]  # `python -m bench.X` runs from the repository


def run_module(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGV`` (``kvstage.cli``, ``bench.transfer``, ...) under the limit."""
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                          text=True, timeout=120, preexec_fn=_limit, check=False, cwd=REPO)


def assert_one_line(proc: subprocess.CompletedProcess[str], *expected: str) -> str:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, lines
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert proc.stdout == ""  # refused before anything ran
    return lines[0]


# -- allocations sized from user input -------------------------------------------------
@pytest.mark.parametrize(
    ("module", "argv", "expected"),
    [
        ("kvstage.cli", ["bench", "copy", "--blocks-per-request", "100000"],
         ["kvstage bench copy: error: --blocks-per-request 100000 (a 400001-block pool of 16 "
          "layers) needs 585.9 GiB of host memory but ", " is available (MemAvailable); lower "
          "--blocks-per-request"]),
        ("kvstage.cli",
         ["bench", "copy", "--preset", "gemma-3-1b", "--prompt-tokens", "100000000"],
         ["--prompt-tokens 100000000 (gemma-3-1b, a 43750001-block pool) needs 6866.5 GiB of "
          "host memory", "lower --prompt-tokens"]),
        # no --preset: a flag error
        ("kvstage.cli", ["bench", "copy", "--prompt-tokens", "100000000"],
         ["--prompt-tokens needs --preset"]),
        ("bench.transfer", ["--num-blocks", "100000000"],
         ["--num-blocks 100000000 (gemma-3-1b, 6103.5 GiB per pool, 4 pools here and in the "
          "prefill child) needs 24414.1 GiB of host memory", "lower --num-blocks"]),
        ("bench.transfer", ["--pipeline", "--sizes-mib", "60000"],
         ["--sizes-mib 60000 (gemma-3-1b, ", "-block pools, 6 of them", "lower --sizes-mib"]),
        ("bench.soak", ["--pool-mib", "4096", "--transport", "loopback"],
         ["--pool-mib 4096 (8 pairs of prefill and decode, each side a device pool and a host "
          "buffer) needs 128.0 GiB of host memory"]),
    ],
    ids=["copy-blocks-per-request", "copy-prompt-tokens", "copy-tokens-no-preset",
         "transfer-num-blocks", "pipeline-sizes", "soak-pool"],
)
def test_allocation_refused_before_allocating(module: str, argv: list[str],
                                              expected: list[str]) -> None:
    assert_one_line(run_module(module, *argv), *expected)


def test_role_pool_checked_against_free_memory(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """prefill/decode: a pool under the 16 GiB cap that does not fit in what is free."""
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 30)  # 1 GiB free
    for command in ("prefill", "decode"):
        # 16384 gemma-3-1b blocks: a 1 GiB pool, and its host buffer as much again
        assert cli_main([command, "--num-blocks", "16384", "--transport", "loopback"]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert lines == [f"kvstage {command}: --num-blocks 16384 (gemma-3-1b, 1.0 GiB per "
                         "pool, device and host) needs 2.0 GiB of host memory but 1.0 GiB is "
                         "available (MemAvailable); lower --num-blocks"]


def test_check_fits_counts_the_device_pool_on_the_host_for_cpu() -> None:
    memory.check_fits("x", 4 << 20, "fix", device_bytes=4 << 20, available=9 << 20)  # 8 <= 8.1
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"^x needs 8.0 MiB of host memory but 8.0 MiB is available "
                             r"\(MemAvailable\); fix$"):
        memory.check_fits("x", 4 << 20, "fix", device_bytes=4 << 20, available=8 << 20)


def test_host_available_bytes_reads_meminfo(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       24000000 kB\nMemAvailable:   1234 kB\n")
    assert memory.host_available_bytes(str(path)) == 1234 * 1024


# -- addresses ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("main", "argv", "expected"),
    [
        (transfer.main, ["--connect", "localhost:abc"],
         "argument --connect: expected HOST:PORT with a port 0-65535 (e.g. 127.0.0.1:5600), "
         "got 'localhost:abc'"),
        (transfer.main, ["--connect", "localhost:0"],
         "argument --connect: --connect needs the peer's port"),
        (transfer.main, ["--listen", "localhost:99999"],
         "argument --listen: expected HOST:PORT with a port 0-65535"),
        (transfer.main, ["--connect", "::1:5600"],
         "argument --connect: IPv6 addresses are not supported yet"),
        (transfer.main, ["--connect", "[::1]:5600"],
         "argument --connect: IPv6 addresses are not supported yet"),
        (transfer.main, ["--connect", "bad host:5600"],
         "host 'bad host' in 'bad host:5600' is not a valid host name or IPv4"),
        (transfer.main, ["--connect", ""], "got ''"),
        (transfer.main, ["--listen", ":0", "--connect", "127.0.0.1:1"],
         "--listen serves the prefill side and --connect measures against one"),
        (cli_main, ["decode", "--connect", "localhost:-1"], "got 'localhost:-1'"),
        (cli_main, ["decode", "--connect", "127.0.0.1:0"], "--connect needs the peer's port"),
        (cli_main, ["prefill", "--listen", "localhost:abc"],
         "argument --listen: expected HOST:PORT"),
        (cli_main, ["prefill", "--listen", "127.0.0.1:65536"], "got '127.0.0.1:65536'"),
    ],
    ids=["connect-abc", "connect-port-0", "listen-99999", "connect-ipv6-bare",
         "connect-ipv6-brackets", "connect-blank-host", "connect-empty", "listen-and-connect",
         "decode-negative-port", "decode-port-0", "prefill-abc", "prefill-65536"],
)
def test_bad_address_one_line(main: Callable[[list[str]], int], argv: list[str], expected: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's exit, or main's return below
        sys.exit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert expected in err


def test_connect_abc_subprocess_one_line() -> None:
    """The adversary's exact command, end to end: no uncaught InvalidRequest."""
    line = assert_one_line(run_module("bench.transfer", "--connect", "localhost:abc"))
    assert line.startswith("python -m bench.transfer: error: argument --connect: ")


# -- numbers ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("main", "argv", "expected"),
    [
        (cli_main, ["bench", "copy", "--seed", "-1"], "--seed must be >= 0, got -1"),
        (cli_main, ["bench", "copy", "--warmup", "-1"], "--warmup must be >= 0"),
        (cli_main, ["bench", "copy", "--num-layers", "100000000"],
         "must be <= 4096, got 100000000"),
        (cli_main, ["bench", "copy", "--threads", "100000"], "must be <= 1024, got 100000"),
        (cli_main, ["bench", "copy", "--floor", "--floor-ids", "100000000"], "must be <= 1048576"),
        (cli_main, ["bench", "copy", "--blocks-per-request", "abc"], "expected a positive integer"),
        (transfer.main, ["--seed", "-1"], "--seed must be >= 0, got -1"),
        (transfer.main, ["--warmup", "-5"], "--warmup must be >= 0"),
        (transfer.main, ["--tokens", "0"], "--tokens must be > 0"),
        (transfer.main, ["--tokens", "1e9"], "--tokens must be an integer, got '1e9'"),
        (transfer.main, ["--num-blocks", "1"], "--num-blocks must be >= 2, got 1"),
        (transfer.main, ["--iters", "nan"], "--iters must be an integer, got 'nan'"),
        (transfer.main, ["--tokens", "100000"],
         "--tokens 100000 needs 6449 gemma-3-1b blocks (every group, the null block), more "
         "than --num-blocks 2048"),
        (transfer.main, ["--pipeline", "--sizes-mib", "0"],
         "--sizes-mib must be > 0 and <= 65536, got 0"),
        (transfer.main, ["--pipeline", "--sizes-mib", "-8"], "--sizes-mib must be > 0"),
        (transfer.main, ["--pipeline", "--num-blocks", "100"],
         "--sizes-mib 128 needs a pool of 14337 gemma-3-1b blocks"),
    ],
    ids=["copy-seed", "copy-warmup", "copy-layers", "copy-threads", "floor-ids", "copy-abc",
         "transfer-seed", "transfer-warmup", "transfer-tokens-0", "transfer-tokens-float",
         "transfer-blocks-1", "transfer-iters-nan", "transfer-tokens-pool", "pipeline-size-0",
         "pipeline-size-negative", "pipeline-pool"],
)
def test_bad_number_one_line(main: Callable[[list[str]], int], argv: list[str], expected: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert expected in err


# -- python -m bench.transfer --pipeline with its defaults -------------------------------
def test_pipeline_defaults_pass_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults (gemma-3-1b, --sizes-mib 8 16 32 64 128, no --num-blocks) get a pool
    that holds the largest request at the prefill and the incremental saves (every group
    of 2048 blocks): 7 x 2048 + 1 blocks. Before the fix they failed with '--sizes-mib 128
    needs more than --num-blocks 2048 blocks'."""
    # whether the defaults (6 pools of 896 MiB: 5.25 GiB, shown as 5.3) pass must not
    # depend on what other processes hold right now: 64 GiB free, then 5.5 GiB
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 64 << 30)
    args = program_parser(transfer, "t").parse_args(["--pipeline"])
    assert args.num_blocks is None and args.sizes_mib == [8, 16, 32, 64, 128]
    lay, blocks = pipeline.resolve(args)
    assert blocks == {8: 128, 16: 256, 32: 512, 64: 1024, 128: 2048}
    assert lay.name == "gemma-3-1b" and lay.num_blocks == 7 * 2048 + 1
    tokens = 2048 * lay.groups[0].spec.block_size
    assert sum(request_blocks(lay, tokens)) == 2246 < lay.num_blocks
    assert pipeline.POOLS * lay.pool_bytes == 6 * 14337 * 65536  # 5.25 GiB
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 11 << 29)  # 5.5 GiB
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--sizes-mib 128 \(gemma-3-1b, "
                       r"14337-block pools, 6 of them with their host buffers\) needs 5.3 GiB "
                       r"of host memory but 5.5 GiB is available"):
        pipeline.resolve(args)
    # a pool one block short of it is refused, with the size that is needed
    args.num_blocks = 7 * 2048
    with pytest.raises(argparse.ArgumentTypeError, match="needs a pool of 14337 gemma-3-1b"):
        pipeline.resolve(args)


def test_pipeline_pool_from_the_prefill_request_when_larger() -> None:
    """llama-3.1-8b (one group): the pool is the request's blocks plus the null block."""
    args = program_parser(transfer, "t").parse_args(["--pipeline", "--preset",
                                                     "llama-3.1-8b", "--sizes-mib", "8", "128"])
    lay, blocks = pipeline.resolve(args)
    assert blocks == {8: 4, 128: 64} and lay.num_blocks == 65
    assert preset("llama-3.1-8b", num_blocks=65).pool_bytes == lay.pool_bytes
