"""`kvstage demo | prefill | decode | bench copy | bench transfer | bench soak | serve-pd |
tiny-model`.

One convention: every command module exposes ``add_arguments(parser)`` and
``run(args) -> int``. The table below names them all; a missing module is an error,
never skipped. No command module imports NIXL or CUDA at import time.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

# (command path, module, help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "kvstage.cli.demo", "prefill -> decode over NIXL on 127.0.0.1, bytes verified"),
    (("prefill",), "kvstage.cli.prefill", "serve a prefill role: side channel, NIXL, host buffer"),
    (("decode",), "kvstage.cli.decode", "run requests against a prefill and verify every byte"),
    (("bench", "copy"), "kvstage.bench.copy", "device<->host copy strategies, op counts, memory"),
    (("bench", "transfer"), "kvstage.bench.transfer", "NIXL READ: merged vs per-block descs"),
    (("bench", "soak"), "kvstage.bench.soak", "many requests with faults; every one accounted for"),
    (("serve-pd",), "kvstage.cli.serve_pd", "P/D vllm api_servers behind vllm-router"),
    (("tiny-model",), "kvstage.cli.tiny_model", "build the tiny hybrid Gemma3 + tokenizer to DIR"),
]


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (exit 2): what was wrong, and where
    the usage is, instead of a usage block a careless value gets lost in."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = OneLineParser(prog="kvstage", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for path, module_name, help_text in COMMANDS:
        module = importlib.import_module(module_name)
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} subcommands")
                groups[path[0]] = g.add_subparsers(dest="subcommand", required=True)
            p = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _prog=p.prog)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except argparse.ArgumentTypeError as exc:  # a value refused after parsing (sizes, keys)
        print(f"{args._prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
