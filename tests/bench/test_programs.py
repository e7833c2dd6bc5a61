"""Every program in the repository's bench/ folder imports and answers ``--help`` (exit 0,
its usage on stdout), so a moved or removed kvstage module breaks this test rather than the
next benchmark run. In-process: ``main`` reads ``sys.argv`` where it takes no argv."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import bench

FOLDER = Path(bench.__file__).parent
MODULES = sorted(m.name for m in pkgutil.iter_modules(bench.__path__))
#: the programs: the modules with a ``main`` (the rest are their parts)
PROGRAMS = [n for n in MODULES if "\ndef main(" in (FOLDER / f"{n}.py").read_text()]


def _import(name: str) -> object:
    try:
        return importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as exc:  # the vllm_* programs that import vLLM at the top
        if (exc.name or "").split(".")[0] != "vllm":
            raise
        pytest.skip(f"bench.{name} needs vLLM (.venv-vllm): {exc}")


def test_programs_found() -> None:
    assert {"soak", "transfer", "serving", "vllm_connector"} <= set(PROGRAMS)
    assert {"hostile", "transfer_bench", "workloads"}.isdisjoint(PROGRAMS)


@pytest.mark.parametrize("name", PROGRAMS)
def test_program_help(name: str, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    module = _import(name)
    monkeypatch.setattr(sys, "argv", [f"python -m bench.{name}", "--help"])
    with pytest.raises(SystemExit) as exc:
        module.main()  # type: ignore[attr-defined]
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "--help" in out


@pytest.mark.parametrize("name", sorted(set(MODULES) - set(PROGRAMS)))
def test_part_imports(name: str) -> None:
    assert _import(name).__doc__  # each part states its contract at the top


@pytest.mark.parametrize(("name", "argv", "says"), [
    ("save_by_chunk", ["--chunks", "1,x"], "--chunks: comma-separated integers"),
    ("save_by_chunk", ["--chunks", "0"], "--chunks: numbers in [1, 64]"),
    ("save_by_chunk", ["--chunk-tokens", "100"], "a multiple of 32"),
    ("save_by_chunk", ["--lease", "0"], "--lease in [1, 600]"),
    ("save_by_chunk", ["--core", "4096"], "--core 4096: expected a core"),
    ("chunked", ["--sizes-mib", "8,y"], "--sizes-mib: comma-separated integers"),
    ("chunked", ["--matmul-n", "4"], "--matmul-n in [16, 8192]"),
    ("step_cost", ["--settle-s", "-1"], "expected seconds in [0, 10], got -1"),
    ("decode_itl", ["--settle-s", "11"], "expected seconds in [0, 10], got 11"),
    ("decode_itl", ["--kv-extra", "kvstage_progress_delay_us=-5"],
     "--kv-extra: KVStageConnector: kv_connector_extra_config kvstage_progress_delay_us=-5"),
    ("step_cost", ["--kv-extra", "kvstage_nope=1"], "unknown kvstage key"),
    ("step_cost", ["--kv-extra", "no-equals"], "--kv-extra expects KEY=VALUE"),
    ("step_cost", ["--trials", "0"], "--trials: expected 1..10"),
    ("step_cost", ["--arrangements", "five"], "--arrangements: expected names from"),
    ("idle_cpu", ["--kinds", "plain,nope"], "--kinds: expected names from"),
    ("idle_cpu", ["--idle-s", "0"], "--idle-s in (0, 600]"),
    ("idle_cpu", ["--env", "NOEQUALS"], "--env: expected KEY=VALUE"),
    ("idle_cpu", ["--cores", "4096"], "--cores [4096]: need at least --tp"),
])
def test_bad_arguments_one_line_exit_2(name: str, argv: list[str], says: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    module = _import(name)
    with pytest.raises(SystemExit) as exc:
        module.main(argv)  # type: ignore[attr-defined]
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and not any("Traceback" in line for line in err)
