"""``--verify-checksum`` end to end: a prefill child (real NIXL) and the decode CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstage.presets import preset
from kvstage.testing.servers import PrefillProcess

pytestmark = pytest.mark.nixl
pytest.importorskip("xxhash")

NUM_BLOCKS = 1024
GEMMA = preset("gemma-3-1b", num_blocks=NUM_BLOCKS)


def decode_cli(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstage.cli", "decode", "--connect", f"127.0.0.1:{port}",
         "--num-blocks", str(NUM_BLOCKS), "--requests", "2", "--prompt-tokens", "512", "1024",
         *extra],
        capture_output=True, text=True, timeout=90,
    )


@pytest.mark.timeout(240)
def test_decode_cli_verifies_checksums_of_a_checksumming_prefill() -> None:
    with PrefillProcess(GEMMA, transport="nixl", verify_checksum=True) as child:
        _, port = child.wait_ready()
        out = decode_cli(port, "--verify-checksum")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        assert "2/2 requests verified byte-exact" in out.stdout
    with PrefillProcess(GEMMA, transport="nixl") as child:  # no checksums there
        _, port = child.wait_ready()
        out = decode_cli(port, "--verify-checksum")
        assert out.returncode != 0
        assert out.stdout.count("prefill sent no checksums") == 2, out.stdout[-2000:]
        out = decode_cli(port)  # off on both sides: as before
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_prefill_cli_has_the_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstage.cli", "prefill", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--verify-checksum" in out.stdout
