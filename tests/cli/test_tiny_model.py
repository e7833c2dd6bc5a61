"""`kvstage tiny-model`: its refusals, one line and exit 2, before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstage.cli import main


def test_kv_heads_is_for_gemma3_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    assert main(["tiny-model", "--arch", "granite", "--kv-heads", "2", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == ("kvstage tiny-model: --kv-heads is for --arch gemma3, got --arch granite; "
                   "drop --kv-heads\n")
    assert not out.exists()


def test_kv_heads_out_of_range_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["tiny-model", "--kv-heads", "3", str(tmp_path / "m")])
    assert exc.value.code == 2
    assert "argument --kv-heads: invalid choice: 3 (choose from 1, 2)" in capsys.readouterr().err
