"""`kvstage serve-pd`: N prefill + M decode `vllm serve` api_servers behind vllm-router.

Starts the deployment with `kvstage.serving.PDCluster` on 127.0.0.1, prints every URL and
the exact command lines it ran (so the same setup can be run by hand), then serves until
SIGINT or SIGTERM and stops everything (router first, then each api_server's process
group; bounded waits). Flags after ``--`` go to every api_server verbatim. Bad arguments:
one line, exit 2, nothing started. Needs vLLM and vllm-router in this Python's venv
(.venv-vllm); this module imports neither.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from kvstage.cli.args import positive
from kvstage.serving import (
    CONNECTORS,
    FAILURE_POLICIES,
    TINY_CPU_ENGINE_ARGS,
    EngineArgs,
    PDCluster,
    ServingError,
)
from kvstage.serving.cluster import DEVICES, default_device, router_executable
from kvstage.serving.engine_args import with_user_flags

MAX_INSTANCES = 16
ENGINE_DEFAULTS = {"vllm": EngineArgs(), "tiny-cpu": TINY_CPU_ENGINE_ARGS}


def _model(text: str) -> str:
    """A local directory with config.json, or a hub id (``org/name``, not a local path)."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"--model {text!r} has no config.json; expected "
                                             "a HuggingFace model directory")
        return str(path.resolve())
    if text.startswith((".", "/", "~")) or path.exists():
        raise argparse.ArgumentTypeError(f"--model {text!r} is not a directory; build the "
                                         "tiny one with `kvstage tiny-model DIR` or give a "
                                         "hub id like google/gemma-3-1b-it")
    return text


def _port(text: str) -> int:
    port = int(positive(int, "--port", high=65535)(text))
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"--port {port} is not free on 127.0.0.1 "
                                             f"({exc.strerror}); pick another") from None
    return port


def _log_dir(text: str) -> str:
    """A directory to write logs into (created at start, with missing parents)."""
    path = Path(text).absolute()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"--log-dir {text!r} exists and is not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot create or write logs under {text!r} "
                                         f"({existing} is not a writable directory)")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=_model,
                   help="model directory (e.g. from `kvstage tiny-model`) or hub id")
    p.add_argument("--prefill", type=positive(int, "--prefill", high=MAX_INSTANCES), default=1,
                   help="prefill instances (default 1)")
    p.add_argument("--decode", type=positive(int, "--decode", high=MAX_INSTANCES), default=1,
                   help="decode instances (default 1)")
    p.add_argument("--port", type=_port, default=8000, help="the router's port (default 8000)")
    p.add_argument("--connector", default="kvstage", choices=CONNECTORS[:2],
                   help="kvstage: KVStageConnector; nixl: vLLM's NixlConnector (on CPU its "
                        "host path, for comparisons)")
    p.add_argument("--kv-load-failure-policy", default="fail", choices=FAILURE_POLICIES,
                   help="what a decode does when the KV READ fails (vLLM's setting)")
    p.add_argument("--device", default="auto", choices=["auto", *DEVICES],
                   help="cpu: pin cores, force the host buffer; cuda: one GPU of "
                        "CUDA_VISIBLE_DEVICES per instance (auto: cuda if a GPU is visible)")
    p.add_argument("--engine-defaults", default="vllm", choices=sorted(ENGINE_DEFAULTS),
                   help="vllm: vLLM's defaults; tiny-cpu: the settings kvstage tests the "
                        "tiny model with (float32, block 32, 64 MiB KV, eager)")
    p.add_argument("--log-dir", type=_log_dir, default=None,
                   help="one log per instance here (default: a new temporary directory)")
    p.add_argument("--start-timeout", type=positive(float, "--start-timeout"), default=600.0,
                   help="seconds each api_server may take to answer /health")
    p.add_argument("--kv-extra", type=_kv_extra, action="append", default=[],
                   metavar="KEY=VALUE", help="a kv_connector_extra_config entry for every "
                   "instance (VALUE read as JSON if it parses, else text), e.g. "
                   "kvstage_verify_checksum=true; repeatable")
    p.add_argument("--key-file", type=_key_file, default=None,
                   help="the shared key file (kvstage_key_file): sealed handshakes and "
                        "capability-checked notifications")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="a flag for vllm-router verbatim, e.g. "
                        "--router-arg=--health-check-interval-secs=5; repeatable")
    p.add_argument("--share-gpus", action="store_true",
                   help="cuda: allow fewer GPUs than instances (instance i on GPU i mod n)")
    p.add_argument("api_server_args", nargs=argparse.REMAINDER,
                   help="after --: flags for every api_server (one given replaces the "
                        "--engine-defaults flag of its name; --model, --host, --port and "
                        "--kv-transfer-config are serve-pd's and refused)")


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _kv_extra(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not _KEY.fullmatch(key):
        raise argparse.ArgumentTypeError(f"--kv-extra expects KEY=VALUE with KEY a name "
                                         f"(letters, digits, _), got {text[:80]!r}")
    if len(value) > 4096:
        raise argparse.ArgumentTypeError(f"--kv-extra {key}: value over 4096 characters")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _key_file(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_file() or not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"--key-file {text!r} is not a readable file; make "
                                         "one with: head -c 32 /dev/urandom | base64 > FILE")
    return str(path.resolve())


class _Stop(Exception):
    """SIGTERM arrived."""


def run(args: argparse.Namespace) -> int:
    extra = list(args.api_server_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:  # the user's flags first: a clash is refused wherever vllm-router is missing
        engine_args = with_user_flags(ENGINE_DEFAULTS[args.engine_defaults], extra)
        router_executable()
    except ServingError as exc:
        print(f"kvstage serve-pd: {exc}", file=sys.stderr)
        return 2
    kv_extra = dict(args.kv_extra)
    if args.key_file:
        kv_extra["kvstage_key_file"] = args.key_file
    if args.log_dir:
        try:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"kvstage serve-pd: cannot create --log-dir {args.log_dir!r} "
                  f"({exc.strerror}); give a writable directory", file=sys.stderr)
            return 2
    device = default_device() if args.device == "auto" else args.device
    try:
            cluster = PDCluster(
            model=args.model, num_prefill=args.prefill, num_decode=args.decode,
            connector=args.connector, kv_load_failure_policy=args.kv_load_failure_policy,
            log_dir=args.log_dir, engine_args=engine_args, device=device,
            router_port=args.port, start_timeout=args.start_timeout,
            extra_kv_config=kv_extra or None, router_args=tuple(args.router_arg),
            share_gpus=args.share_gpus)
    except ServingError as exc:  # e.g. fewer GPUs than instances: nothing started
        print(f"kvstage serve-pd: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if not started.is_set():
            raise _Stop

    started = threading.Event()
    previous = signal.signal(signal.SIGTERM, on_signal)
    print(f"kvstage serve-pd: starting {args.prefill} prefill + {args.decode} decode "
          f"({args.connector}, {device}); logs in {cluster.log_dir}", flush=True)
    try:
        for inst in cluster.instances:
            print(f"  {inst.name}: {inst.url}  (NIXL side channel port "
                  f"{inst.side_channel_port}, log {inst.log_path})\n    $ {inst.command_line()}",
                  flush=True)
        try:
            cluster.start()
        except (ServingError, _Stop) as exc:
            print(f"kvstage serve-pd: {exc or 'stopped by SIGTERM'}", file=sys.stderr)
            return 1
        started.set()
        router = cluster.router
        assert router is not None
        print(f"  router: {router.url}\n    $ {router.command_line()}", flush=True)
        print(f"kvstage serve-pd: ready: {router.url}/v1/completions (Ctrl-C stops all)",
              flush=True)
        signal.signal(signal.SIGINT, on_signal)
        reported: set[str] = set()
        while not stop.wait(1.0):
            for inst in [router, *cluster.instances]:
                if not inst.alive and inst.name not in reported:
                    reported.add(inst.name)
                    print(f"kvstage serve-pd: {inst.name} exited; log ends:\n"
                          f"{inst.log_tail(2000)}", file=sys.stderr, flush=True)
        print("kvstage serve-pd: stopping", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
