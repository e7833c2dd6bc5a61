"""`python -m bench.transfer --quick`: JSON structure and exact descriptor counts (no
timing is asserted: it depends on the machine and whatever else runs on it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.transfer import main
from kvstage.blocks import request_blocks
from kvstage.presets import preset

pytestmark = pytest.mark.nixl
REPO = Path(__file__).resolve().parents[2]  # `python -m bench.transfer` runs from here

GEMMA = preset("gemma-3-1b", num_blocks=2048)
BLOCKS = sum(request_blocks(GEMMA, 8192))  # 6 x 33 sliding-window + 512 full = 710


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "transfer.json"
    assert main(["--quick", "--json", str(path)]) == 0
    return json.loads(Path(path).read_text())


def _rows(doc: dict[str, Any], ids: str) -> dict[str, dict[str, Any]]:
    return {r["method"]: r for r in doc["results"] if r["ids"] == ids}


@pytest.mark.timeout(120)
def test_json_structure(quick: dict[str, Any]) -> None:
    assert set(quick) >= {"config", "env", "results"}
    cfg = quick["config"]
    assert cfg["quick"] is True and cfg["tokens"] == 8192 and cfg["ids"] == "both"
    assert cfg["iters"] == 3 and cfg["warmup"] == 1
    assert not any(k.startswith("_") for k in cfg)
    assert len(quick["results"]) == 6
    for r in quick["results"]:
        assert r["samples"] == 3 and r["median_ms"] > 0 and r["gbps"] > 0
        assert r["nbytes"] == BLOCKS * GEMMA.block_bytes
        assert r["blocks"] == BLOCKS
    assert _rows(quick, "contiguous")["one_large"]["pct_of_one_large"] == pytest.approx(100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ids", ["contiguous", "scattered"])
def test_exact_descriptor_counts(quick: dict[str, Any], ids: str) -> None:
    rows = _rows(quick, ids)
    runs = rows["merged"]["runs"]
    if ids == "contiguous":
        assert runs == 1
    else:
        assert 1 < runs < BLOCKS  # churned pools: pieces, not single blocks
    assert rows["merged"]["descriptors"] == runs  # block-major: one per run
    # vLLM's granularity: one per (tensor, plane, block): 4 tensors x 1 plane x 710
    assert rows["per_block"]["descriptors"] == BLOCKS * GEMMA.num_tensors * GEMMA.num_planes
    assert rows["per_block"]["descriptors"] == 2840
    assert rows["one_large"]["descriptors"] == 1
    assert rows["merged"]["verified"] is True and rows["per_block"]["verified"] is True


def _listen(num_blocks: int) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "bench.transfer", "--listen", "127.0.0.1:0",
           "--preset", "gemma-3-1b", "--num-blocks", str(num_blocks)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONUNBUFFERED": "1"}, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:  # the first line says where it listens (or why it failed)
        if line.startswith("kvstage prefill listening on "):
            return proc, line.split()[4]
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"listener did not start: {proc.communicate()[0]}")


@pytest.mark.timeout(180)
def test_listen_connect_split_twice_against_one_listener(tmp_path: Path) -> None:
    # the two-host form: --listen on the prefill host, --connect on the decode host. A
    # second run against the same listener works only if the first gave back its blocks.
    proc, address = _listen(2048)
    try:
        for run in range(2):
            path = tmp_path / f"run{run}.json"
            argv = ["--connect", address, "--quick", "--json", str(path)]
            assert main(argv) == 0
            doc = json.loads(path.read_text())
            assert doc["config"]["connect"] == address
            for ids in ("contiguous", "scattered"):
                rows = _rows(doc, ids)
                assert rows["merged"]["verified"] is True
                assert rows["per_block"]["verified"] is True
                assert rows["merged"]["nbytes"] == BLOCKS * GEMMA.block_bytes
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "held_at_stop=0" in out, out  # every request of both runs was released


@pytest.mark.timeout(60)
def test_connect_refused_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["--connect", f"127.0.0.1:{port}", "--quick"]) == 2
    assert "refused" in capsys.readouterr().err


def test_listen_and_connect_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--listen", "127.0.0.1:0", "--connect", "127.0.0.1:1"]) == 2
    assert "pass one of them" in capsys.readouterr().err
