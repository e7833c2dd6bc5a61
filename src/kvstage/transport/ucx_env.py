"""UCX settings for a role, chosen from the address it listens on or connects to
(``kvstage prefill --listen``, ``kvstage decode --connect``, an instance's side-channel host).

Rules, per variable; the first that applies wins:

1. the variable is already in the environment: kept as it is (the user's word);
2. the role's flag (``--ucx-tls``, ``--ucx-net-devices``, ``--ucx-tcp-seg-size``);
3. automatic, from the address:

   - loopback (127.0.0.0/8, ::1, ``localhost``): ``UCX_TLS=tcp,sm,self,cma`` on ``lo``, the
     same-host defaults of ``kvstage.transport.nixl.default_ucx_env`` (nothing else: the
     bytes move by CMA);
   - a wildcard (``0.0.0.0``, ``::``): ``tcp`` on ``all`` (UCX offers every device; each
     peer uses one it can reach), with the TCP segments below;
   - any other address: ``tcp`` on the one interface that owns it (this host's address)
     or that the kernel routes it through (a peer's address). The source address of a
     route lookup (a UDP ``connect``, which sends nothing) names that interface; if
     there is no route, ``all``. With the TCP segments below.

Why ``tcp`` alone off loopback: shared memory and CMA only work between processes of
one kernel. Across hosts UCX would not pick them anyway, but between two network
namespaces of one host it does (measured: ``UCX_PROTO_INFO=y`` shows the READ as
``cma/memory``), and the bytes then never cross the link. Why one device rather than
``all``: READs and notifications then take the same path as the side channel, not
whichever other NIC UCX finds reachable.

Why larger TCP segments off loopback (``UCX_TCP_TX_SEG_SIZE=64k``,
``UCX_TCP_RX_SEG_SIZE=256k``): over tcp UCX has no remote read; a READ is emulated, the
peer answering with active messages of at most one TX segment (UCX's default 8 KiB), each
a ``send`` and a copy through a receive buffer of one RX segment (default 64 KiB).
Measured across two namespaces (``python -m bench.tcp_link``, BENCHMARKS "How fast is the
READ across hosts over TCP?"), 128 MiB requests: with UCX's defaults the READ got 60-63 %
of the same run's plain TCP stream; with 64k TX segments 83-108 %, as with 256k. Why not
more than 64k: a peer whose RX segment is smaller than our TX segment crashes (measured: a
decode left at UCX's 64k RX was killed by SIGSEGV when its prefill sent 256k segments),
and 64k is UCX's default RX, so a peer that kept UCX's defaults (another version, a
process started without these settings) still receives ours; the measured gain is the
same. RX 256k leaves room for a peer told to send larger segments.

`choose(host)` is the one entry point: the CLI roles apply it (`apply`), kvstage's serving
helpers hand its ``env`` to vLLM instances, and a connector passes ``choose(host).env`` to
its transport (``NixlTransport(name, ucx_env=...)``).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["UcxChoice", "apply", "choose", "interface_for", "local_addresses"]

SAME_HOST_TLS = "tcp,sm,self,cma"  # kvstage.transport.nixl.default_ucx_env()
ACROSS_HOSTS_TLS = "tcp"
# off loopback (module doc): TX no larger than UCX's default RX (64k), RX with room to spare
TCP_TX_SEG_SIZE = "64k"
TCP_RX_SEG_SIZE = "256k"
SEG_KEYS = ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")
_SEGS = {"UCX_TCP_TX_SEG_SIZE": TCP_TX_SEG_SIZE, "UCX_TCP_RX_SEG_SIZE": TCP_RX_SEG_SIZE}
KEYS = ("UCX_TLS", "UCX_NET_DEVICES", *SEG_KEYS)


@dataclass(frozen=True)
class UcxChoice:
    """The value of each UCX variable and why it has it."""

    env: dict[str, str]
    why: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return " ".join(f"{k}={v} ({self.why[k]})" for k, v in self.env.items())


class _Sockaddr(ctypes.Structure):
    # Linux struct sockaddr, long enough for sockaddr_in6 (28 bytes)
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("ifu", ctypes.c_void_p),
    ("data", ctypes.c_void_p),
]


def local_addresses() -> dict[str, str]:
    """Every IPv4/IPv6 address of this network namespace -> its interface (getifaddrs)."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return {}
    out: dict[str, str] = {}
    try:
        node = head
        while node:
            ifa = node.contents
            if ifa.addr and ifa.name:
                sa = ifa.addr.contents
                raw = bytes(sa.data)
                if sa.family == socket.AF_INET:
                    out[socket.inet_ntop(socket.AF_INET, raw[2:6])] = ifa.name.decode()
                elif sa.family == socket.AF_INET6:
                    out[socket.inet_ntop(socket.AF_INET6, raw[6:22])] = ifa.name.decode()
            node = ifa.next
    finally:
        libc.freeifaddrs(head)
    return out


def _resolve(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (socket.gaierror, IndexError) as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc}") from None


def _route_source(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((str(ip), 9))  # a route lookup only: UDP connect sends nothing
        except OSError:
            return None
        return str(s.getsockname()[0])


def interface_for(host: str) -> str | None:
    """The interface that owns ``host``, else the one the kernel routes it through."""
    ip = _resolve(host)
    addrs = local_addresses()
    if str(ip) in addrs:
        return addrs[str(ip)]
    source = _route_source(ip)
    return addrs.get(source) if source else None


def _auto(host: str) -> tuple[dict[str, str], dict[str, str]]:
    """(values, reasons) of the variables the address sets (none of SEG_KEYS on loopback)."""
    ip = _resolve(host)
    if ip.is_loopback:
        why = f"auto: {host} is loopback"
        return ({"UCX_TLS": SAME_HOST_TLS, "UCX_NET_DEVICES": "lo"},
                dict.fromkeys(("UCX_TLS", "UCX_NET_DEVICES"), why))
    dev = "all" if ip.is_unspecified else interface_for(host)
    off = f"auto: {host} is not loopback"
    return {"UCX_TLS": ACROSS_HOSTS_TLS, "UCX_NET_DEVICES": dev or "all", **_SEGS}, {
        "UCX_TLS": off,
        "UCX_NET_DEVICES": (
            f"auto: {host} is every address" if ip.is_unspecified
            else f"auto: {dev} carries {host}" if dev
            else f"auto: no interface found for {host}"
        ),
        **dict.fromkeys(SEG_KEYS, off),
    }


def choose(
    host: str,
    *,
    tls: str | None = None,
    net_devices: str | None = None,
    tcp_seg_size: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> UcxChoice:
    """The UCX variables for a role bound to or dialling ``host`` (module doc): its
    ``env`` is the whole setting, to apply before the NIXL agent is created."""
    flags = {"UCX_TLS": (tls, "--ucx-tls"), "UCX_NET_DEVICES": (net_devices, "--ucx-net-devices"),
             **dict.fromkeys(SEG_KEYS, (tcp_seg_size, "--ucx-tcp-seg-size"))}
    auto: tuple[dict[str, str], dict[str, str]] | None = None
    env: dict[str, str] = {}
    why: dict[str, str] = {}
    for key in KEYS:
        value, flag = flags[key]
        if key in environ:
            env[key], why[key] = environ[key], "from the environment"
        elif value:
            env[key], why[key] = value, flag
        else:
            auto = auto or _auto(host)
            if key in auto[0]:
                env[key], why[key] = auto[0][key], auto[1][key]
    return UcxChoice(env, why)


def apply(choice: UcxChoice) -> None:
    """Put the choice in ``os.environ`` (before NIXL is imported: UCX reads it then)."""
    for key, value in choice.env.items():
        os.environ.setdefault(key, value)
