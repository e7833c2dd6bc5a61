"""The shared key on the CLI: --key-file / KVSTAGE_KEY / --insecure, refused with one line
and exit 2 before anything starts (no bind, no connect, no NIXL agent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstage.cli import main as cli_main
from kvstage.pd import auth

NOT_HERE = "10.255.255.1"  # a non-loopback address: never bound nor reached by these tests


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = cli_main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "key"
    path.write_bytes(content)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_non_loopback_without_a_key_is_refused(role: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    flag = "--listen" if role == "prefill" else "--connect"
    rc, err = run_cli([role, flag, f"{NOT_HERE}:5600", "--transport", "loopback"], capsys)
    assert rc == 2
    action = "listen on" if role == "prefill" else "connect to"
    assert f"refusing to {action} {NOT_HERE} without a key" in err
    assert "--insecure" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("content", "mode", "expected"),
    [
        (b"", 0o600, "is empty"),
        (b"\n  \n", 0o600, "is empty"),
        (b"short", 0o600, "at least 16 bytes"),
        (b"k" * 32, 0o644, "readable by group or others (mode 644); run `chmod 600"),
        (b"k" * 32, 0o640, "readable by group or others (mode 640)"),
    ],
    ids=["empty", "blank", "short", "world-readable", "group-readable"],
)
def test_bad_key_file_is_refused(content: bytes, mode: int, expected: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = key_file(tmp_path, content, mode)
    rc, err = run_cli(["prefill", "--key-file", path, "--transport", "loopback"], capsys)
    assert rc == 2 and expected in err and err.count("\n") == 1


def test_missing_key_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run_cli(["decode", "--key-file", str(tmp_path / "nope"),
                       "--transport", "loopback"], capsys)
    assert rc == 2 and "cannot read key file" in err and "No such file" in err


def test_short_key_in_the_environment_is_refused(capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.KEY_ENV, "short")
    rc, err = run_cli(["prefill", "--transport", "loopback"], capsys)
    assert rc == 2 and "at least 16 bytes" in err


def test_insecure_warns_on_stderr(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.KEY_ENV, raising=False)
    # port 0 on an address this host does not have: the warning, then the bind fails
    rc, err = run_cli(["prefill", "--listen", f"{NOT_HERE}:0", "--insecure",
                       "--transport", "loopback", "--num-blocks", "16"], capsys)
    assert f"kvstage prefill: WARNING: --insecure: the side channel on {NOT_HERE} is not " \
           "authenticated" in err
    assert rc == 2 and "cannot start" in err


def test_load_key(tmp_path: Path) -> None:
    path = key_file(tmp_path, b"  secret-key-of-32-bytes-exactly!\n")
    env = {auth.KEY_ENV: "from-the-environment-key"}
    assert auth.load_key(path, env) == b"secret-key-of-32-bytes-exactly!"  # the file wins
    assert auth.load_key(None, env) == b"from-the-environment-key"
    assert auth.load_key(None, {}) is None
    with pytest.raises(ValueError, match="not a regular file"):
        auth.load_key(str(tmp_path), {})
