"""CLI arguments: careless values refused with one line and exit 2."""

from __future__ import annotations

import pytest

from kvstage.cli import main as cli_main


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["decode", "--requests", "0"],
         "argument --requests: --requests must be > 0 and <= 1e+06, got 0"),
        (["decode", "--prompt-tokens", "-1"], "--prompt-tokens must be > 0"),
        (["decode", "--read-timeout-s", "abc"], "--read-timeout-s must be a number, got 'abc'"),
        (["prefill", "--lease-s", "0"], "--lease-s must be > 0 and <= 86400, got 0"),
        (["bench", "copy", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["bench", "soak", "--requests", "0"], "--requests must be > 0 and <= 1e+07, got 0"),
        (["bench", "soak", "--fault-rate", "1.5"], "--fault-rate must be >= 0 and <= 1, got 1.5"),
        (["bench", "soak", "--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
        # careless input: NaN and infinities never pass for a positive number
        (["prefill", "--lease-s", "nan"], "--lease-s must be a finite number, got 'nan'"),
        (["decode", "--read-timeout-s", "nan"], "--read-timeout-s must be a finite number"),
        (["decode", "--handshake-timeout-s", "inf"], "--handshake-timeout-s must be a finite"),
        (["bench", "soak", "--lease-s=-inf"], "--lease-s must be a finite number"),
        (["decode", "--num-blocks", "1"], "--num-blocks must be >= 2, got 1"),
        (["decode", "--prompt-tokens", "100000000"], "--prompt-tokens must be > 0 and <= "),
        (["decode", "--json", "/nonexistent/x.json"], "folder '/nonexistent' of"),
    ],
    ids=["decode-requests", "decode-tokens", "decode-timeout", "prefill-lease", "copy-iters",
         "soak-requests", "soak-fault-rate", "soak-transport", "lease-nan", "read-nan",
         "handshake-inf", "soak-lease-inf", "num-blocks-1", "prompt-1e8", "json-unwritable"],
)
def test_cli_flag_out_of_range(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


