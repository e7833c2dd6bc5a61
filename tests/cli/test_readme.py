"""README.md's commands run as written.

Every line of README's ``sh`` blocks is a command a user types. Each one is run here the
cheapest way that still proves it: ``make`` targets with ``make -n`` (nothing built),
``kvstage serve-pd`` with ``--dry-run`` (the command lines it would start, every argument
checked), ``kvstage tiny-model`` for real where transformers is installed, the key recipe
for real into a temporary directory, ``curl``'s JSON body parsed. A command of a kind this
file has no rule for fails the test, so a new command cannot slip through unchecked.
README's ``python`` block runs as is. Beyond the blocks, every ``kvstage ...`` command
named anywhere in README and the guides (``docs/*.md``) must exist: ``kvstage <subcommand>
--help`` exits 0 (a stale name such as ``kvstage bench transfer`` fails here).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
KVSTAGE = [sys.executable, "-m", "kvstage.cli"]
TIMEOUT_S = 120


def sh_commands(text: str) -> list[str]:
    """The commands of the ``sh`` blocks: continuations joined, comments dropped."""
    out: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  # ")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def named_subcommands(text: str) -> set[tuple[str, ...]]:
    """Every ``kvstage WORD [WORD]`` in code spans and blocks (the words before any flag,
    path or placeholder)."""
    found: set[tuple[str, ...]] = set()
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"^```\w*\n(.*?)^```", text,
                                                             re.MULTILINE | re.DOTALL)
    for span in spans:
        for m in re.finditer(r"(?:^|[\s/])kvstage((?: [a-z][a-z-]*)+)", span):
            words = tuple(m.group(1).split())
            if words and words[0] in {"demo", "prefill", "decode", "bench", "serve-pd",
                                      "tiny-model"} | {"transfer", "soak", "serve"}:
                found.add(words[:2] if words[0] == "bench" else words[:1])
    return found


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The environment README's commands run in here: a stand-in ``vllm-router`` on PATH
    (``serve-pd --role router`` looks for it before printing), never a GPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    router = bin_dir / "vllm-router"
    router.write_text("#!/bin/sh\nexit 0\n")
    router.chmod(0o755)
    out = dict(os.environ)
    out["PATH"] = f"{bin_dir}{os.pathsep}{out.get('PATH', '')}"
    out.pop("KVSTAGE_KEY", None)
    return out


def check(command: str, tmp_path: Path, env: dict[str, str], made: dict[str, Path]) -> str:
    """Run one README command the cheapest faithful way; return what was run."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        name, _, value = words.pop(0).partition("=")
        if name != "CUDA_VISIBLE_DEVICES":
            env = {**env, name: value}
    head = words[0]
    if head == "make":
        proc = run(["make", "-n", *words[1:]], env)
        assert proc.returncode == 0, f"{command}: {proc.stderr}"
        return "make -n " + " ".join(words[1:])
    if head == "head" and "/dev/urandom" in command:
        key = tmp_path / "kvstage.key"
        made["/etc/kvstage.key"] = key
        proc = subprocess.run(command.replace("/etc/kvstage.key", str(key)), shell=True,
                              cwd=ROOT, env=env, timeout=TIMEOUT_S, check=False)
        assert proc.returncode == 0 and key.stat().st_mode & 0o777 == 0o600, command
        assert len(key.read_text().strip()) >= 16
        return command
    if head == "curl":
        body = words[words.index("-d") + 1]
        assert isinstance(json.loads(body), dict), command
        assert "max_tokens" in json.loads(body)
        return "curl's JSON body parsed"
    if head.endswith("kvstage"):
        args = [str(made.get(w, w)) for w in words[1:]]
        if args[0] == "tiny-model":
            directory = Path(args[-1])
            args[-1] = str(tmp_path / directory.name)
            made[str(directory)] = Path(args[-1])
            proc = run([*KVSTAGE, *args], env)
            if proc.returncode != 0:  # .venv has no transformers: the CLI says where it runs
                assert "needs transformers" in proc.stderr, proc.stderr
                Path(args[-1]).mkdir(parents=True, exist_ok=True)
                (Path(args[-1]) / "config.json").write_text("{}")  # a stand-in for serve-pd
            return "kvstage " + " ".join(args)
        if args[0] == "serve-pd":
            if "--dry-run" not in args:
                args.append("--dry-run")
            args += ["--log-dir", str(tmp_path / "logs")]
            proc = run([*KVSTAGE, *args], env)
            assert proc.returncode == 0, f"{command}:\n{proc.stdout}\n{proc.stderr}"
            assert "vllm.entrypoints.openai.api_server" in proc.stdout or (
                "--role" in args and "router" in args), proc.stdout
            return "kvstage " + " ".join(args)
        raise AssertionError(f"README runs `{command}`: add a rule for kvstage {args[0]}")
    raise AssertionError(f"README runs `{command}`: this test has no rule for `{head}`")


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 210


def test_readme_commands_run_as_written(tmp_path: Path, env: dict[str, str]) -> None:
    commands = sh_commands(README.read_text())
    assert any(c.startswith("make demo") for c in commands)
    assert any(c.startswith("make test") for c in commands)
    made: dict[str, Path] = {}
    ran = [check(c, tmp_path, env, made) for c in commands]
    assert len(ran) == len(commands)
    print("\n".join(ran))


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_kvstage_command_named_exists(doc: Path) -> None:
    for words in sorted(named_subcommands(doc.read_text())):
        proc = subprocess.run([*KVSTAGE, *words, "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=TIMEOUT_S, check=False)
        assert proc.returncode == 0, (
            f"{doc.name} names `kvstage {' '.join(words)}`, which the CLI does not have: "
            f"{proc.stderr.strip().splitlines()[-1:]}")


def test_a_stale_command_is_caught() -> None:
    text = "run `kvstage bench transfer --listen 0.0.0.0:1` there"
    assert named_subcommands(text) == {("bench", "transfer")}
    proc = subprocess.run([*KVSTAGE, "bench", "transfer", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode != 0


def test_readme_library_lines_run() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    assert blocks, "README's library lines are a ```python block"
    for block in blocks:
        proc = subprocess.run([sys.executable, "-c", block], cwd=ROOT, capture_output=True,
                              text=True, timeout=TIMEOUT_S, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "'runs': 2" in proc.stdout, proc.stdout
