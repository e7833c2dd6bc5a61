"""CLI arguments (kvstage and the soak program): careless values refused with one line and
exit 2."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import soak
from kvstage.cli import main as cli_main


@pytest.mark.parametrize(
    ("main", "argv", "expected"),
    [
        (cli_main, ["decode", "--requests", "0"],
         "argument --requests: --requests must be > 0 and <= 1e+06, got 0"),
        (cli_main, ["decode", "--prompt-tokens", "-1"], "--prompt-tokens must be > 0"),
        (cli_main, ["decode", "--read-timeout-s", "abc"],
         "--read-timeout-s must be a number, got 'abc'"),
        (cli_main, ["prefill", "--lease-s", "0"], "--lease-s must be > 0 and <= 86400, got 0"),
        (cli_main, ["bench", "copy", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (soak.main, ["--requests", "0"], "--requests must be > 0 and <= 1e+07, got 0"),
        (soak.main, ["--fault-rate", "1.5"], "--fault-rate must be >= 0 and <= 1, got 1.5"),
        (soak.main, ["--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
        # careless input: NaN and infinities never pass for a positive number
        (cli_main, ["prefill", "--lease-s", "nan"],
         "--lease-s must be a finite number, got 'nan'"),
        (cli_main, ["decode", "--read-timeout-s", "nan"],
         "--read-timeout-s must be a finite number"),
        (cli_main, ["decode", "--handshake-timeout-s", "inf"],
         "--handshake-timeout-s must be a finite"),
        (soak.main, ["--lease-s=-inf"], "--lease-s must be a finite number"),
        (cli_main, ["decode", "--num-blocks", "1"], "--num-blocks must be >= 2, got 1"),
        (cli_main, ["decode", "--prompt-tokens", "100000000"],
         "--prompt-tokens must be > 0 and <= "),
        (cli_main, ["decode", "--json", "/nonexistent/x.json"], "folder '/nonexistent' of"),
    ],
    ids=["decode-requests", "decode-tokens", "decode-timeout", "prefill-lease", "copy-iters",
         "soak-requests", "soak-fault-rate", "soak-transport", "lease-nan", "read-nan",
         "handshake-inf", "soak-lease-inf", "num-blocks-1", "prompt-1e8", "json-unwritable"],
)
def test_cli_flag_out_of_range(
    main: Callable[[list[str]], int], argv: list[str], expected: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err




def test_decode_pipelines_off_loopback_by_default() -> None:
    """`kvstage decode`: --pipeline / --no-pipeline as given, else on for a prefill off
    loopback (every chunk in flight fills a TCP link one READ does not), off on loopback."""
    from kvstage.cli.decode import pipelined

    assert pipelined(None, "10.77.0.1") is True
    assert pipelined(None, "127.0.0.1") is False
    assert pipelined(None, "localhost") is False
    assert pipelined(False, "10.77.0.1") is False
    assert pipelined(True, "127.0.0.1") is True
