"""Fixtures the CLI tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A directory that passes serve-pd's --model check (a config.json in it)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path
