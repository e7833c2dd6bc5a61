"""`kvstage bench transfer --quick`: JSON structure and exact descriptor counts (no
timing is asserted: it depends on the machine and whatever else runs on it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvstage.blocks import request_blocks
from kvstage.cli import main
from kvstage.layout import preset

pytestmark = pytest.mark.nixl

GEMMA = preset("gemma-3-1b", num_blocks=2048)
BLOCKS = sum(request_blocks(GEMMA, 8192))  # 6 x 33 sliding-window + 512 full = 710


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("bench") / "transfer.json"
    assert main(["bench", "transfer", "--quick", "--json", str(path)]) == 0
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
