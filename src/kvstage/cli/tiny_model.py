"""`kvstage tiny-model [--arch A] [--kv-heads N] DIR`: build a tiny random hybrid model with
its tokenizer: the sliding-window Gemma3 (default; ``--kv-heads 2`` splits its heads over
TP 2), or a state-space / linear-attention hybrid (granite: GraniteMoeHybrid Mamba2 +
attention, nemotron: NemotronH, falconh1: FalconH1, all float32; qwen3next: Qwen3-Next gated
delta net + attention, bfloat16: serve it with --dtype bfloat16).

Writes config, safetensors (fixed seed: byte-identical on every build) and a word-level
tokenizer into DIR, for `kvstage serve-pd` and vLLM on CPU. Needs torch + transformers
(.venv-vllm has them); imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _out_dir(text: str) -> str:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not (path / "config.json").exists():
        raise argparse.ArgumentTypeError(f"{text!r} is a non-empty directory without a "
                                         "model in it; give a new or empty directory")
    return text


ARCHES = ("gemma3", "granite", "nemotron", "qwen3next", "falconh1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", default="gemma3", choices=ARCHES,
                   help="gemma3 (sliding window + full attention, default) or a state hybrid")
    p.add_argument("--kv-heads", type=int, default=1, choices=(1, 2),
                   help="gemma3 only: KV heads (1, default: replicated at TP 2; 2: split "
                        "over TP 2 ranks, for prefill and decode at different TP sizes)")
    p.add_argument("dir", type=_out_dir, help="output directory (created; a previous build "
                                              "there is overwritten)")


def run(args: argparse.Namespace) -> int:
    if args.arch != "gemma3" and args.kv_heads != 1:
        print(f"kvstage tiny-model: --kv-heads is for --arch gemma3, got --arch {args.arch}; "
              "drop --kv-heads", file=sys.stderr)
        return 2
    try:
        import transformers  # noqa: F401 (only to fail early with one line)
    except ImportError:
        print("kvstage tiny-model: needs transformers (and torch); run it with "
              ".venv-vllm/bin/kvstage (make .venv-vllm/.kvstage-vllm-installed)",
              file=sys.stderr)
        return 2
    from kvstage.testing.tiny_gemma3 import build_tiny_gemma3
    from kvstage.testing.tiny_hybrids import BUILDERS

    if args.arch == "gemma3":
        print(build_tiny_gemma3(args.dir, num_kv_heads=args.kv_heads).resolve())
    else:
        print(BUILDERS[args.arch](args.dir).resolve())
    return 0
