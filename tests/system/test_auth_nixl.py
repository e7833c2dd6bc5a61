"""Side-channel security over real NIXL (UCX on 127.0.0.1): a keyed prefill in a child
process, a keyed decode reading byte-exact, a key holder forging the completion
notification through its own NIXL agent (refused: wrong capability), a keyless decode
that never gets the NIXL metadata, and the CLI roles with --key-file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstage.errors import PeerError, Unauthorized
from kvstage.pd import auth
from kvstage.pd import messages as m
from kvstage.pd.side_channel import SideChannelClient
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillProcess, make_decode

pytestmark = pytest.mark.nixl

LAYOUT = preset("gemma-3-1b", num_blocks=512)
NB = LAYOUT.num_blocks
KEY = b"nixl-test-key-" + b"1" * 18


@pytest.fixture(scope="module")
def keyed_prefill() -> Iterator[PrefillProcess]:
    proc = PrefillProcess(LAYOUT, transport="nixl", lease_s=30.0, key=KEY)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def stats(addr: tuple[str, int]) -> m.Stats:
    s = SideChannelClient(*addr, timeout_s=20.0, key=KEY).call(m.GetStats())
    assert isinstance(s, m.Stats)
    return s


@pytest.mark.timeout(180)
def test_forged_notification_over_nixl_frees_nothing(keyed_prefill: PrefillProcess) -> None:
    addr = keyed_prefill.wait_ready()
    client = SideChannelClient(*addr, timeout_s=20.0, key=KEY)
    with make_decode(LAYOUT, transport="nixl", key=KEY, read_timeout_s=15.0,
                     handshake_timeout_s=20.0) as hostile, \
            make_decode(LAYOUT, transport="nixl", key=KEY, read_timeout_s=15.0,
                        handshake_timeout_s=20.0) as decode:
        done = client.call(m.PrefillRequest(request_id="victim", num_tokens=500, seed=3))
        assert isinstance(done, m.PrefillDone)
        before = stats(addr)
        # a key holder: it has the metadata, so its own NIXL agent can notify prefill
        peer = hostile.connect(*addr).peer
        hostile.transport.send_notif(peer, b"victim")  # the pre-capability form
        hostile.transport.send_notif(peer, auth.completion_notif("victim", bytes(16)))
        deadline = time.monotonic() + 20.0
        while True:
            s = stats(addr)
            if s.bad_capability - before.bad_capability == 2:
                break
            assert time.monotonic() < deadline, "forged notifications never processed"
            time.sleep(0.05)
        assert (s.held_requests, s.completed) == (1, before.completed)
        res = decode.start("victim", addr, done.block_ids, capability=done.capability)
        if res.status == "pending":
            res = decode.wait("victim", 20.0)
        assert res.ok, res.reason
        assert verify_request(decode.cache, res.local_block_ids, 3) == []
        decode.finish("victim")
        deadline = time.monotonic() + 20.0
        while stats(addr).completed == before.completed:  # decode's own notification
            assert time.monotonic() < deadline
            time.sleep(0.05)
        s = stats(addr)
        assert (s.held_requests, s.free_blocks, s.open_handles) == (0, NB - 1, 0)


@pytest.mark.timeout(120)
def test_keyless_decode_gets_no_metadata(keyed_prefill: PrefillProcess) -> None:
    addr = keyed_prefill.wait_ready()
    before = stats(addr).unauthorized
    with make_decode(LAYOUT, transport="nixl", handshake_timeout_s=20.0) as keyless:
        with pytest.raises(PeerError) as err:
            keyless.connect(*addr)
        assert err.value.remote_code == Unauthorized.code
        assert keyless.transport.num_open_handles == 0
    assert stats(addr).unauthorized == before + 1


@pytest.mark.timeout(240)
def test_cli_roles_with_a_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(KEY + b"\n")
    os.chmod(key, 0o600)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("UCX_") and k != auth.KEY_ENV} | {"PYTHONUNBUFFERED": "1"}
    log = tmp_path / "prefill.log"
    common = ["--preset", "gemma-3-1b", "--num-blocks", "512"]
    with log.open("w") as out:
        prefill = subprocess.Popen(
            [sys.executable, "-m", "kvstage.cli", "prefill", "--listen", "127.0.0.1:0",
             "--key-file", str(key), *common], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "listening on" not in log.read_text():
            assert prefill.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        line = next(ln for ln in log.read_text().splitlines() if "listening on" in ln)
        assert "auth=key" in line
        where = line.split("listening on ")[1].split()[0]
        decode = [sys.executable, "-m", "kvstage.cli", "decode", "--connect", where,
                  "--requests", "2", "--prompt-tokens", "256", "--handshake-timeout-s",
                  "30", *common]
        keyless = subprocess.run(decode, capture_output=True, text=True, timeout=150, env=env)
        assert keyless.returncode == 2, keyless.stdout + keyless.stderr
        assert "unauthorized" in keyless.stderr or "no MAC" in keyless.stderr
        keyed = subprocess.run([*decode, "--key-file", str(key)], capture_output=True,
                               text=True, timeout=150, env=env)
        assert keyed.returncode == 0, keyed.stdout + keyed.stderr
        assert "2/2 requests verified byte-exact" in keyed.stdout
    finally:
        prefill.terminate()
        prefill.wait(30)
