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
import tempfile
import threading
from collections.abc import Callable, Sequence
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
from kvstage.serving.cluster import DEVICES, MAX_TP, default_device, router_executable
from kvstage.serving.engine_args import with_user_flags
from kvstage.serving.instances import Instance
from kvstage.serving.kv_config import free_ports
from kvstage.serving.roles import ROLES, check_url, host_instances, host_router

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
    return int(positive(int, "--port", high=65535)(text))


def _host(text: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9.:\-]{1,253}", text):
        raise argparse.ArgumentTypeError(f"--host expects an address or host name, got "
                                         f"{text[:80]!r}")
    return text


def _check_free(host: str, ports: list[int]) -> None:
    """ServingError naming the first of ``ports`` that cannot be bound on ``host``."""
    for port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                raise ServingError(f"--port {port} is not free on {host} ({exc.strerror}); "
                                   "pick another") from None


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
    p.add_argument("--prefill-tp", type=positive(int, "--prefill-tp", high=MAX_TP), default=1,
                   help="tensor-parallel size of each prefill instance (default 1)")
    p.add_argument("--decode-tp", type=positive(int, "--decode-tp", high=MAX_TP), default=1,
                   help="tensor-parallel size of each decode instance (default 1; another "
                        "than --prefill-tp: each side cuts its pages for the other's size, "
                        "README \"Tensor parallelism\"; --role prefill/decode need both)")
    p.add_argument("--port", type=_port, default=8000,
                   help="the router's port; with --role prefill/decode the first instance's "
                        "(instance i: port + i) (default 8000)")
    p.add_argument("--role", default="all", choices=("all", *ROLES),
                   help="all: the whole deployment on this machine (127.0.0.1); prefill, "
                        "decode or router: this host's part of a deployment across hosts")
    p.add_argument("--host", type=_host, default="127.0.0.1",
                   help="with --role: the address this host's instances bind and peers use "
                        "(a routable one needs --key-file)")
    p.add_argument("--side-channel-port", type=positive(int, "--side-channel-port",
                                                        high=65535), default=5600,
                   help="with --role prefill/decode: instance i's NIXL side channel port is "
                        "this + i (default 5600, vLLM's)")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL",
                   help="--role router: a prefill instance, http://HOST:PORT; repeatable")
    p.add_argument("--decode-url", action="append", default=[], metavar="URL",
                   help="--role router: a decode instance, http://HOST:PORT; repeatable")
    p.add_argument("--dry-run", action="store_true",
                   help="print the command lines (for your own supervisor) and exit")
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
                   help="cuda: allow fewer GPUs than instances x TP size (GPUs reused in "
                        "order, mod the number visible)")
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
    try:  # every refusal before anything starts, a clash first wherever vllm-router is
        engine_args = with_user_flags(ENGINE_DEFAULTS[args.engine_defaults], extra)
        kv_extra = dict(args.kv_extra)
        if args.key_file:
            kv_extra["kvstage_key_file"] = args.key_file
        count = {"prefill": args.prefill, "decode": args.decode}.get(args.role, 1)
        if args.prefill_tp != args.decode_tp:
            if args.connector != "kvstage":
                raise ServingError(f"--prefill-tp {args.prefill_tp} and --decode-tp "
                                   f"{args.decode_tp} differ: serve-pd maps different sizes "
                                   "with --connector kvstage only")
            if args.role in ("prefill", "decode"):  # the other side's TP size
                kv_extra["kvstage_peer_tp_size"] = (args.decode_tp if args.role == "prefill"
                                                    else args.prefill_tp)
        if args.role == "all" and args.host != "127.0.0.1":
            raise ServingError("--host is for --role prefill/decode/router (one host's part); "
                               "--role all runs everything on 127.0.0.1")
        if args.role != "router" and (args.prefill_url or args.decode_url):
            raise ServingError("--prefill-url/--decode-url are for --role router")
        if args.role == "router":
            if not args.prefill_url or not args.decode_url:
                raise ServingError("--role router needs at least one --prefill-url and one "
                                   "--decode-url (the instances' http://HOST:PORT)")
            for url in (*args.prefill_url, *args.decode_url):
                check_url(url)
        if not args.dry_run:
            _check_free(args.host, [args.port + i for i in range(count)])
        if args.role in ("all", "router"):
            router_executable()
    except ServingError as exc:
        print(f"kvstage serve-pd: {exc}", file=sys.stderr)
        return 2
    if args.log_dir and not args.dry_run:
        try:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"kvstage serve-pd: cannot create --log-dir {args.log_dir!r} "
                  f"({exc.strerror}); give a writable directory", file=sys.stderr)
            return 2
    device = default_device() if args.device == "auto" else args.device
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvstage-serve-"))
    try:
        if args.role == "all":
            cluster = PDCluster(
                model=args.model, num_prefill=args.prefill, num_decode=args.decode,
                connector=args.connector, kv_load_failure_policy=args.kv_load_failure_policy,
                log_dir=log_dir, engine_args=engine_args, device=device,
                prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                router_port=args.port, start_timeout=args.start_timeout,
                extra_kv_config=kv_extra or None, router_args=tuple(args.router_arg),
                share_gpus=args.share_gpus)
            servers, router = cluster.instances, None
        elif args.role == "router":
            servers, router = [], host_router(
                args.prefill_url, args.decode_url, host=args.host, port=args.port,
                metrics_port=free_ports(1)[0],
                log_dir=log_dir, extra=tuple(args.router_arg))
        else:
            servers, router = host_instances(
                args.role, args.model, count=count, host=args.host, port=args.port,
                side_channel_port=args.side_channel_port, engine_args=engine_args,
                connector=args.connector, policy=args.kv_load_failure_policy,
                kv_extra=kv_extra, device=device, log_dir=log_dir,
                share_gpus=args.share_gpus,
                tp=args.prefill_tp if args.role == "prefill" else args.decode_tp), None
    except ServingError as exc:  # e.g. fewer GPUs than instances, no key: nothing started
        print(f"kvstage serve-pd: {exc}", file=sys.stderr)
        return 2
    if args.connector == "nixl" and device == "cpu" and args.role != "router":
        print("kvstage serve-pd: --connector nixl on CPU runs vLLM's own host path through "
              "kvstage.testing.vllm_baseline (forced on where vLLM's CPU platform turns it "
              "off), for comparisons only: it gives wrong tokens on hybrid models and does "
              "not start on Mamba ones; serve with --connector kvstage", file=sys.stderr,
              flush=True)
    what = (f"{args.prefill} prefill + {args.decode} decode" if args.role == "all"
            else f"{len(servers)} {args.role}" if servers else "the router")
    print(f"kvstage serve-pd: {'commands for' if args.dry_run else 'starting'} {what} "
          f"({args.connector}, {device}); logs in {log_dir}", flush=True)
    for inst in [*servers, *([router] if router else [])]:
        side = (f"NIXL side channel {inst.host}:{inst.side_channel_port}, "
                if inst.side_channel_port else "")
        print(f"  {inst.name}: {inst.url}  ({side}log {inst.log_path})\n"
              f"    $ {inst.command_line()}", flush=True)
    if args.dry_run:
        return 0
    if args.role == "all":
        return _serve(cluster.start, cluster.stop, lambda: [cluster.router, *servers],
                      lambda: cluster.router)
    watched = [*servers, *([router] if router else [])]

    def start() -> None:
        for inst in watched:  # spawn all, then wait: engines load in parallel
            inst.spawn()
        for inst in watched:
            inst.wait_ready(args.start_timeout)

    def stop() -> None:
        for inst in reversed(watched):
            inst.stop()

    return _serve(start, stop, lambda: watched, lambda: router)


def _serve(start: Callable[[], object], stop: Callable[[], None],
           watched: Callable[[], Sequence[Instance | None]],
           router: Callable[[], Instance | None]) -> int:
    """Start, serve until SIGINT/SIGTERM (reporting any process that exits), stop."""
    done = threading.Event()
    started = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()
        if not started.is_set():
            raise _Stop

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        try:
            start()
        except (ServingError, _Stop) as exc:
            print(f"kvstage serve-pd: {exc or 'stopped by SIGTERM'}", file=sys.stderr)
            return 1
        started.set()
        front = router()
        if front is not None:
            print(f"  router: {front.url}\n    $ {front.command_line()}", flush=True)
            print(f"kvstage serve-pd: ready: {front.url}/v1/completions (Ctrl-C stops all)",
                  flush=True)
        else:
            print("kvstage serve-pd: ready (Ctrl-C stops all)", flush=True)
        signal.signal(signal.SIGINT, on_signal)
        reported: set[str] = set()
        while not done.wait(1.0):
            for inst in watched():
                if inst is not None and not inst.alive and inst.name not in reported:
                    reported.add(inst.name)
                    print(f"kvstage serve-pd: {inst.name} exited; log ends:\n"
                          f"{inst.log_tail(2000)}", file=sys.stderr, flush=True)
        print("kvstage serve-pd: stopping", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop()
        signal.signal(signal.SIGTERM, previous)
