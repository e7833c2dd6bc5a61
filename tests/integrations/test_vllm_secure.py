"""The connector's key settings: where the key comes from, the refusals, and the
unauthenticated loopback case. The attacks on real engines (no metadata without the key,
forged and replayed notifications): tests/system/vllm/test_vllm_side_channel_auth.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvstage.integrations.vllm import secure
from kvstage.integrations.vllm.config import KVStageConfig

KEY = b"k" * 32
ENGINE = "engine-a"


def _config(**extra: object) -> KVStageConfig:
    return KVStageConfig.parse(extra)  # the connector's settings, as it parses them


@pytest.fixture(scope="module")
def config() -> KVStageConfig:
    return _config()


# -- the key ------------------------------------------------------------------------------
def test_key_from_the_environment(config: KVStageConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTAGE_KEY", KEY.decode())
    assert secure.Security.from_config(config, side_channel_host="10.1.2.3").key == KEY


def test_key_file_wins_and_must_be_private(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTAGE_KEY", KEY.decode())
    path = tmp_path / "key"
    path.write_bytes(b"f" * 24 + b"\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by group or others.*chmod 600"):
        secure.Security.from_config(_config(kvstage_key_file=str(path)))
    path.chmod(0o600)
    assert secure.Security.from_config(_config(kvstage_key_file=str(path))).key == b"f" * 24


def test_no_key_off_loopback_refuses_unless_opted_in(
    config: KVStageConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"refusing to serve the side channel on "
                       r"10\.1\.2\.3 without a key.*kvstage_allow_unauthenticated"):
        secure.Security.from_config(config, side_channel_host="10.1.2.3")
    opted = secure.Security.from_config(_config(kvstage_allow_unauthenticated=True),
                                        side_channel_host="10.1.2.3")
    assert opted.key is None


def test_no_key_on_loopback_works_and_says_so_once(
    config: KVStageConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)
    monkeypatch.setattr(secure, "_warned_unauthenticated", False)
    logging.getLogger(secure.logger.name).propagate = True
    with caplog.at_level(logging.WARNING, logger=secure.logger.name):
        for host in ("127.0.0.1", "localhost", "127.0.0.1"):
            assert secure.Security.from_config(config, side_channel_host=host).key is None
    assert [r.getMessage().count("is not authenticated") for r in caplog.records] == [1]


def test_bad_settings_are_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)
    with pytest.raises(ValueError, match="kvstage_allow_unauthenticated='yes': expected true "
                                         "or false"):
        secure.Security.from_config(_config(kvstage_allow_unauthenticated="yes"))
    with pytest.raises(ValueError, match="kvstage_key_file=3: expected a path string"):
        secure.Security.from_config(_config(kvstage_key_file=3))
    monkeypatch.setenv("KVSTAGE_KEY", "short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        secure.Security.from_config(_config())


# -- capabilities and notifications ---------------------------------------------------------
