"""Arguments every command shares, and validators that refuse careless input up front.

A bad value gets one line from argparse (exit 2) naming the flag, what arrived and what
is expected: NaN, infinities and non-positive numbers are refused wherever a positive
number is meant, and an output path is checked writable before any work starts.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from kvstage.cache import HostLayout
from kvstage.cli import memory
from kvstage.layout import KVLayout
from kvstage.pd import auth
from kvstage.pd.side_channel import parse_address
from kvstage.presets import PRESETS, preset
from kvstage.transport import TRANSPORTS, ucx_env

DEFAULT_BLOCKS = {"llama-3.1-8b": 192, "gpt-oss-20b": 768}
#: the most blocks a CLI pool may have (a 2048-block gemma-3-1b pool is 1 GiB); a larger
#: request is refused before anything is allocated
MAX_POOL_BYTES = 16 << 30


def number(kind: type, name: str, *, low: float = 0.0, inclusive: bool = False,
           high: float = math.inf) -> Callable[[str], Any]:
    """An argparse type: ``kind`` (int or float), finite, ``> low`` (``>=`` if inclusive),
    ``<= high``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number, got {text!r}")
        ok = value >= low if inclusive else value > low
        if not ok or value > high:
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            top = f" and <= {high:g}" if high < math.inf else ""
            raise argparse.ArgumentTypeError(f"{name} must be {bound}{top}, got {text}")
        return value

    return parse


def positive(kind: type, name: str, high: float = math.inf) -> Callable[[str], Any]:
    return number(kind, name, high=high)


def fraction(name: str) -> Callable[[str], float]:
    """A float in [0, 1]."""
    return number(float, name, low=0.0, inclusive=True, high=1.0)


def address(name: str, *, listen: bool) -> Callable[[str], str]:
    """An argparse type for ``HOST:PORT`` (`parse_address`'s rules: a port 0-65535, no
    IPv6, no blanks); port 0 (any free port) only where the command listens. Returns the
    text unchanged."""

    def parse(text: str) -> str:
        try:
            _host, port = parse_address(text)
        except ValueError as exc:  # InvalidRequest: one line, exit 2
            raise argparse.ArgumentTypeError(str(exc)) from None
        if port == 0 and not listen:
            raise argparse.ArgumentTypeError(
                f"{name} needs the peer's port (port 0 means 'any free port' and only works "
                f"where the command listens), got {text!r}")
        return text

    return parse


def writable_path(suffix: str | None = None) -> Callable[[str], str]:
    """An output path whose folder exists and is writable (checked before the run)."""

    def parse(text: str) -> str:
        if suffix and not text.endswith(suffix):
            raise argparse.ArgumentTypeError(f"expected a path ending in {suffix}, got {text!r}")
        folder = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"folder {folder!r} of {text!r} does not exist")
        if not os.access(folder, os.W_OK) or (os.path.exists(text) and not os.access(text,
                                                                                      os.W_OK)):
            raise argparse.ArgumentTypeError(f"cannot write {text!r} (permission denied)")
        return text

    return parse


def add_transport_argument(p: argparse.ArgumentParser, default: str = "nixl") -> None:
    p.add_argument("--transport", default=default, choices=sorted(TRANSPORTS),
                   help="nixl: real NIXL/UCX; loopback: in-process (tests)")


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="gemma-3-1b", choices=sorted(PRESETS))
    p.add_argument("--num-blocks", type=number(int, "--num-blocks", low=2, inclusive=True),
                   default=None,
                   help="blocks in the pool (default: 2048, fewer for large-page presets)")
    p.add_argument("--host-layout", default="block_major", choices=[h.value for h in HostLayout])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    add_transport_argument(p)


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    """The preset at ``--num-blocks``; a pool over `MAX_POOL_BYTES`, or a pool and its host
    buffer over the free memory (`memory.check_fits`), is refused (exit 2) before anything
    is allocated."""
    blocks = args.num_blocks or DEFAULT_BLOCKS.get(args.preset, 2048)
    layout = preset(args.preset, num_blocks=blocks)
    if layout.pool_bytes > MAX_POOL_BYTES:
        raise argparse.ArgumentTypeError(
            f"--num-blocks {blocks} makes a {layout.pool_bytes / 2**30:.1f} GiB {args.preset} "
            f"pool; at most {MAX_POOL_BYTES >> 30} GiB (device and host each)"
        )
    # the role holds a device pool and a host buffer of the same size
    memory.check_fits(f"--num-blocks {blocks} ({args.preset}, "
                      f"{memory.gib(layout.pool_bytes)} per pool, device and host)",
                      layout.pool_bytes, "lower --num-blocks", device=args.device,
                      device_bytes=layout.pool_bytes)
    return layout


def add_ucx_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ucx-tls", default=None,
                   help="UCX_TLS for this process (default: from the address; the "
                        "environment's UCX_TLS wins)")
    p.add_argument("--ucx-net-devices", default=None,
                   help="UCX_NET_DEVICES for this process, e.g. eth0 or all (default: the "
                        "interface that carries the address; the environment's wins)")
    p.add_argument("--ucx-tcp-seg-size", default=None, type=ucx_size("--ucx-tcp-seg-size"),
                   metavar="SIZE",
                   help="UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE both (default off "
                        f"loopback: TX {ucx_env.TCP_TX_SEG_SIZE}, RX {ucx_env.TCP_RX_SEG_SIZE}; "
                        "unset on loopback; the environment's wins). Give every peer the "
                        "same: UCX crashes a peer whose RX segment is smaller than the TX "
                        "segment sent to it")


def ucx_size(flag: str) -> Callable[[str], str]:
    """A UCX memory size (``256k``, ``1m``, ``65536``): 1 KiB to 64 MiB, kept as written."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20}

    def parse(text: str) -> str:
        m = re.fullmatch(r"(\d+)([a-z]*)", text.strip().lower())
        nbytes = int(m.group(1)) * units[m.group(2)] if m and m.group(2) in units else 0
        if not (1 << 10) <= nbytes <= (64 << 20):
            raise argparse.ArgumentTypeError(
                f"{flag}: expected a size from 1k to 64m such as 256k or 1m; got {text!r}")
        return text.strip().lower()

    return parse


def setup_ucx(args: argparse.Namespace, host: str) -> str:
    """Apply the UCX choice for ``host`` (nixl transport only); returns what was chosen."""
    if args.transport != "nixl":
        return f"ucx: not used (--transport {args.transport})"
    choice = ucx_env.choose(host, tls=args.ucx_tls, net_devices=args.ucx_net_devices,
                            tcp_seg_size=getattr(args, "ucx_tcp_seg_size", None))
    ucx_env.apply(choice)
    return "ucx: " + choice.describe()


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key-file", default=None, metavar="PATH",
                   help="shared key authenticating the side channel (a file readable by its "
                        f"owner only, >= {auth.MIN_KEY_BYTES} bytes); else ${auth.KEY_ENV}; "
                        "the same key on prefill and decode")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback address without a key (anyone who reaches "
                        "the port can release requests and READ the host buffer)")


def key_from_args(args: argparse.Namespace, host: str, command: str) -> bytes | None:
    """The shared key (``--key-file``, else `auth.KEY_ENV`), checked against ``host``:
    a non-loopback address without a key raises ArgumentTypeError unless ``--insecure``
    (then one warning line on stderr)."""
    try:
        key = auth.load_key(args.key_file)
        auth.check_bind(host, key, insecure=args.insecure,
                        action="listen on" if command == "prefill" else "connect to")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if key is None and not auth.is_loopback(host):
        print(f"kvstage {command}: WARNING: --insecure: the side channel on {host} is not "
              "authenticated; anyone who reaches it can release requests and READ the "
              "host buffer", file=sys.stderr)
    return key


def add_json_argument(p: argparse.ArgumentParser, what: str = "the rows") -> None:
    p.add_argument("--json", default=None, metavar="PATH.json", type=writable_path(),
                   help=f"write {what} as JSON here")


def add_integrity_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify-checksum", action="store_true",
                   help="end-to-end check: prefill hashes every block at d2h (xxh3-64), "
                        "decode checks the READ bytes before h2d and fails a request whose "
                        "bytes differ (code checksum_mismatch); set it on both sides "
                        "(needs kvstage[integrity])")
