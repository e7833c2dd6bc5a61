"""`kvstage demo | prefill | decode | bench copy | serve-pd | tiny-model`.

One convention: every command module exposes ``add_arguments(parser)`` and
``run(args) -> int``. The table below names them all, with their one-line help, and is
read lazily: ``kvstage --help`` lists every command without importing one, and ``kvstage
CMD ...`` imports CMD's module alone (``serve-pd`` loads no bench or test code). A missing
module is an error when its command runs (and in tests/core/test_import_graph.py), never
skipped. No command module imports NIXL or CUDA at import time.

Benchmark and soak programs live outside the package, in the repository's ``bench/``
folder (``python -m bench.transfer``, ``python -m bench.soak``, ...); they parse and fail
as these commands do through `run_program`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

# (command path, module, help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "kvstage.cli.demo", "prefill -> decode over NIXL on 127.0.0.1, bytes verified"),
    (("prefill",), "kvstage.cli.prefill", "serve a prefill role: side channel, NIXL, host buffer"),
    (("decode",), "kvstage.cli.decode", "run requests against a prefill and verify every byte"),
    (("bench", "copy"), "kvstage.bench.copy", "device<->host copy strategies, op counts, memory"),
    (("serve-pd",), "kvstage.cli.serve_pd", "P/D vllm api_servers behind vllm-router"),
    (("tiny-model",), "kvstage.cli.tiny_model", "build the tiny hybrid Gemma3 + tokenizer to DIR"),
]


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (exit 2): what was wrong, and where
    the usage is, instead of a usage block a careless value gets lost in."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def selected_command(argv: Sequence[str]) -> tuple[str, ...] | None:
    """The COMMANDS path ``argv`` starts with (``("bench", "copy")`` for ``bench copy
    --iters 3``), or None (``--help``, a group alone, an unknown word: argparse answers)."""
    for path, _, _ in COMMANDS:
        if tuple(argv[: len(path)]) == path:
            return path
    return None


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """Every command's subparser, with its help; the arguments (and so the module) only of
    the command ``argv`` selects."""
    chosen = selected_command(argv)
    parser: argparse.ArgumentParser = OneLineParser(
        prog="kvstage", description="Stage paged KV-cache blocks through a host buffer; "
        "prefill/decode roles, their demo, the copy bench and vLLM P/D serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, module_name, help_text in COMMANDS:
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} subcommands")
                groups[path[0]] = g.add_subparsers(dest="subcommand", required=True)
            p = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        if path == chosen:
            _attach(p, importlib.import_module(module_name))
    return parser


def _attach(parser: argparse.ArgumentParser, module: ModuleType) -> None:
    module.add_arguments(parser)
    parser.set_defaults(_run=module.run, _prog=parser.prog)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args) or 0)
    except argparse.ArgumentTypeError as exc:  # a value refused after parsing (sizes, keys)
        print(f"{args._prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return _run(build_parser(argv).parse_args(argv))


def program_parser(module: ModuleType, prog: str) -> argparse.ArgumentParser:
    """The parser of a program outside the package (``module`` has ``add_arguments`` and
    ``run``; its docstring's first line is the description)."""
    description = (module.__doc__ or "").strip().split("\n\n")[0]
    parser: argparse.ArgumentParser = OneLineParser(prog=prog, description=description)
    _attach(parser, module)
    return parser


def run_program(module: ModuleType, prog: str, argv: Sequence[str] | None = None) -> int:
    """Run ``module`` as a program with the commands' conventions: one-line errors and
    exit 2 for bad input (also for values refused after parsing), 130 on Ctrl-C."""
    return _run(program_parser(module, prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
