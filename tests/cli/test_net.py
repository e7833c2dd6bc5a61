"""UCX settings from the address, and the role commands' verdicts on an unusable peer
(refused, incompatible version or layout, a request the prefill refuses). Loopback only:
the two-"host" runs are in test_netns.py."""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvstage.cli import main, net
from kvstage.errors import HandshakeTimeout, LayoutMismatch, PeerError, ProtocolMismatch
from kvstage.presets import preset
from kvstage.testing.servers import make_prefill
from kvstage.transport import ucx_env
from kvstage.transport.base import TransportError

# ---------------------------------------------------------------- choosing UCX settings


@pytest.mark.timeout(10)
def test_loopback_keeps_the_same_host_settings() -> None:
    for host in ("127.0.0.1", "127.3.4.5", "::1", "localhost"):
        c = ucx_env.choose(host, environ={})
        assert c.env == {"UCX_TLS": "tcp,sm,self,cma", "UCX_NET_DEVICES": "lo"}, host


SEGS = {"UCX_TCP_TX_SEG_SIZE": "64k", "UCX_TCP_RX_SEG_SIZE": "256k"}


@pytest.mark.timeout(10)
def test_wildcard_is_tcp_on_every_device() -> None:
    for host in ("0.0.0.0", "::"):
        c = ucx_env.choose(host, environ={})
        assert c.env == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "all", **SEGS}, host


@pytest.mark.timeout(10)
def test_other_addresses_get_tcp_on_the_interface_that_carries_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ucx_env, "local_addresses", lambda: {"127.0.0.1": "lo",
                                                             "10.9.0.5": "eth7"})
    monkeypatch.setattr(ucx_env, "_route_source", lambda ip: "10.9.0.5")
    owned = ucx_env.choose("10.9.0.5", environ={})  # prefill --listen on its own address
    routed = ucx_env.choose("10.9.0.77", environ={})  # decode --connect to a peer
    for c in (owned, routed):
        assert c.env == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth7", **SEGS}
    assert "eth7 carries 10.9.0.77" in routed.describe()
    assert "UCX_TCP_TX_SEG_SIZE=64k (auto: 10.9.0.77 is not loopback)" in routed.describe()
    monkeypatch.setattr(ucx_env, "_route_source", lambda ip: None)  # no route
    assert ucx_env.choose("10.8.0.1", environ={}).env == {
        "UCX_TLS": "tcp", "UCX_NET_DEVICES": "all", **SEGS}


@pytest.mark.timeout(10)
def test_tcp_segments_environment_then_flag_then_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_env, "interface_for", lambda host: "eth7")
    flag = ucx_env.choose("10.9.0.77", tcp_seg_size="1m", environ={})
    assert flag.env == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth7",
                        "UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
    assert flag.why["UCX_TCP_RX_SEG_SIZE"] == "--ucx-tcp-seg-size"
    # UCX's own default kept for TX because the user set it; RX still from the flag
    env = {"UCX_TCP_TX_SEG_SIZE": "8k"}
    mixed = ucx_env.choose("10.9.0.77", tcp_seg_size="1m", environ=env)
    assert mixed.env["UCX_TCP_TX_SEG_SIZE"] == "8k" and mixed.env["UCX_TCP_RX_SEG_SIZE"] == "1m"
    assert mixed.why["UCX_TCP_TX_SEG_SIZE"] == "from the environment"
    # on loopback nothing is tuned unless asked: the bytes move by CMA
    assert ucx_env.choose("127.0.0.1", tcp_seg_size="1m", environ={}).env == {
        "UCX_TLS": "tcp,sm,self,cma", "UCX_NET_DEVICES": "lo",
        "UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}


@pytest.mark.timeout(10)
def test_seg_size_flag_refuses_bad_sizes_in_one_line() -> None:
    from kvstage.cli.args import ucx_size

    parse = ucx_size("--ucx-tcp-seg-size")
    assert parse("256K") == "256k" and parse("1m") == "1m" and parse("65536") == "65536"
    for bad in ("", "0", "512", "1g", "128m", "fast", "1.5m", "-1k"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a size from 1k to 64m"):
            parse(bad)


@pytest.mark.timeout(10)
def test_serving_instances_get_the_same_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstage.serving import cluster

    for key in ucx_env.KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ucx_env, "interface_for", lambda host: "eth7")
    assert cluster.across_hosts_ucx("10.9.0.5") == ucx_env.choose("10.9.0.5").env == {
        "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth7", **SEGS}
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8k")  # the operator's word reaches the child
    assert cluster.across_hosts_ucx("10.9.0.5")["UCX_TCP_TX_SEG_SIZE"] == "8k"
    # an address that does not resolve: the same, minus the interface
    assert cluster.across_hosts_ucx("no-such-host.invalid") == {
        "UCX_TLS": "tcp", "UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "256k"}


@pytest.mark.timeout(10)
def test_environment_wins_then_flags_then_auto() -> None:
    env = {"UCX_NET_DEVICES": "mlx5_0:1"}
    c = ucx_env.choose("127.0.0.1", tls="tcp", net_devices="eth0", environ=env)
    assert c.env == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "mlx5_0:1"}
    assert c.why == {"UCX_TLS": "--ucx-tls", "UCX_NET_DEVICES": "from the environment"}


@pytest.mark.timeout(10)
def test_local_addresses_include_loopback() -> None:
    assert ucx_env.local_addresses().get("127.0.0.1") == "lo"
    assert ucx_env.interface_for("127.0.0.1") == "lo"


@pytest.mark.timeout(10)
def test_apply_never_overrides_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    ucx_env.apply(ucx_env.UcxChoice({"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}))
    import os

    assert os.environ["UCX_TLS"] == "rc,tcp" and os.environ["UCX_NET_DEVICES"] == "eth0"


# ---------------------------------------------------------------- verdicts on the peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(10)
def test_probe_tells_refused_from_listening() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        net.probe("127.0.0.1", srv.getsockname()[1])
    with pytest.raises(net.PeerUnavailable, match="refused the connection"):
        net.probe("127.0.0.1", _free_port())


@pytest.mark.timeout(10)
def test_explain_names_the_failure() -> None:
    where = "h:1"
    assert "did not answer" in net.explain(HandshakeTimeout("x"), where)
    # decided on the class or the peer's code: the same text with another code reads
    # differently, so no branch depends on wording
    assert "incompatible version" in net.explain(ProtocolMismatch("anything"), where)
    assert "incompatible version" in net.explain(PeerError("x", "protocol_mismatch"), where)
    assert "incompatible layout" in net.explain(LayoutMismatch("anything"), where)
    assert "incompatible layout" not in net.explain(
        ValueError("incompatible KV layout: num_blocks is 1 here, 2 remote"), where)
    assert "--ucx-net-devices" in net.explain(TransportError("NIXL_ERR_BACKEND"), where)
    assert "refused the handshake" in net.explain(PeerError("no"), where)


LAYOUT = ["--preset", "gemma-3-1b", "--num-blocks", "512", "--transport", "loopback"]


@contextlib.contextmanager
def prefill_thread(num_blocks: int = 512) -> Iterator[str]:
    worker = make_prefill(preset("gemma-3-1b", num_blocks=num_blocks), transport="loopback")
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{worker.address[1]}"
    finally:
        worker.stop()
        thread.join(10)
        worker.close()


@pytest.mark.timeout(60)
def test_decode_refused_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--connect", f"127.0.0.1:{_free_port()}", *LAYOUT]) == 2
    assert "refused the connection" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_decode_incompatible_layout_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with prefill_thread(num_blocks=1024) as addr:
        assert main(["decode", "--connect", addr, *LAYOUT]) == 2
    err = capsys.readouterr().err
    assert "incompatible layout" in err and "num_blocks is 512 here, 1024 remote" in err


@pytest.mark.timeout(60)
def test_decode_incompatible_version_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:  # a kvstage of another protocol version
        if sock.poll(20_000):
            *envelope, _ = sock.recv_multipart()
            sock.send_multipart([*envelope, msgspec.msgpack.encode({"type": "meta",
                                                                    "version": 99})])

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        assert main(["decode", "--connect", f"127.0.0.1:{port}", *LAYOUT]) == 2
    finally:
        t.join(25)
        sock.close(linger=0)
    err = capsys.readouterr().err
    assert "incompatible version" in err and "version 99" in err


@pytest.mark.timeout(60)
def test_a_refused_request_is_a_failed_row(capsys: pytest.CaptureFixture[str]) -> None:
    with prefill_thread() as addr:  # 8192 tokens need 710 blocks: prefill refuses
        rc = main(["decode", "--connect", addr, *LAYOUT, "--requests", "2",
                   "--prompt-tokens", "8192", "512"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED:" in out and "needs 710 blocks" in out
    assert "ok, bytes verified" in out and "1/2 requests verified byte-exact" in out
