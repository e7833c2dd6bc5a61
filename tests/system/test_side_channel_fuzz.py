"""Fuzz a live prefill's side channel (real NIXL, prefill in a child process), with and
without a key, for a bounded time (``KVSTAGE_FUZZ_S`` seconds per case, default 10):
random bytes, deep nesting, mutated valid messages, replays, forged Release/Acquire
with wrong capabilities, sealed garbage (what a key holder could send), while an honest
decode keeps reading. Then: the prefill is alive, every honest request was byte-exact,
no reply echoed more than a few KiB, and nothing leaked (held 0, every block free, no
open handle, every prefilled request freed exactly once). The seed is fixed per case,
so a failure replays; the counts are printed (``-s``) for RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections import Counter
from collections.abc import Callable

import pytest
import zmq

from kvstage.pd import auth
from kvstage.pd import messages as m
from kvstage.pd.decode import DecodeWorker
from kvstage.pd.side_channel import SideChannelClient
from kvstage.presets import preset
from kvstage.testing.pattern import verify_request
from kvstage.testing.servers import PrefillProcess, make_decode
from tests.helpers import wait_prefill_free

pytestmark = pytest.mark.nixl

FUZZ_S = float(os.environ.get("KVSTAGE_FUZZ_S", "10"))
LAYOUT = preset("gemma-3-1b", num_blocks=512)
NB = LAYOUT.num_blocks
KEY = b"fuzz-key-" + b"0" * 23
MAX_ECHO = 4096  # no reply but Meta/Stats/PrefillDone may be larger than this
REPLY_TIMEOUT_MS = 20_000  # a loaded 2-core host; a missing reply fails the test


class Fuzzer:
    def __init__(self, addr: tuple[str, int], key: bytes | None, seed: int) -> None:
        self.rng = random.Random(seed)
        self.key = key
        self.sealer = auth.Authenticator(key)
        self.opener = auth.Authenticator(key)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.endpoint = f"tcp://{addr[0]}:{addr[1]}"
        self.sock = self._socket()
        self.kinds: Counter[str] = Counter()
        self.replies: Counter[str] = Counter()
        self.held: dict[str, bytes] = {}  # requests the fuzz got held -> capability
        self.captured: list[bytes] = []  # valid sealed messages, for replays
        self.victims: list[str] = []  # held by the honest decode (forged at)

    def _socket(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        self.sock.close(linger=0)

    # -- inputs ---------------------------------------------------------------------------
    def valid(self) -> m.Message:
        r = self.rng
        rid = r.choice([*self.victims, *self.held, f"fz-{r.randrange(10**6)}", ""])
        cap = r.choice([b"", bytes(16), r.randbytes(16), r.randbytes(r.randrange(40))])
        choices: list[Callable[[], m.Message]] = [
            lambda: m.GetStats(),
            lambda: m.GetMeta(engine_id=r.choice(["x", "é" * 50])),
            lambda: m.Acquire(request_id=rid, capability=cap),
            lambda: m.Release(request_id=rid, capability=cap),
            lambda: m.PrefillRequest(request_id=f"fz-{r.randrange(10**9)}",
                                     num_tokens=r.choice([1, 17, 64, 0, -5, 10**9]),
                                     seed=r.randrange(-(2**63), 2**63)),
            lambda: m.Ok(),
            lambda: m.Error(message="x" * r.randrange(600)),
        ]
        return r.choice(choices)()

    def mutate(self, data: bytes) -> bytes:
        r = self.rng
        b = bytearray(data)
        for _ in range(r.randrange(1, 6)):
            op = r.randrange(4)
            if op == 0 and b:
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            elif op == 1 and b:
                del b[r.randrange(len(b)):]
            elif op == 2:
                i = r.randrange(len(b) + 1)
                b[i:i] = r.randbytes(r.randrange(1, 32))
            elif b:
                i = r.randrange(len(b))
                b[i] = r.choice([0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDE, 0xFF])
        return bytes(b)

    def one(self) -> bytes:
        r = self.rng
        kind = r.choice(["random", "nested", "mutated", "replay", "forged", "sealed_junk",
                         "wrong_key"])
        self.kinds[kind] += 1
        if kind == "random":
            return r.randbytes(r.choice([0, 1, 8, 64, 1024, 60_000]))
        if kind == "nested":
            depth = r.choice([1000, 10_000, 200_000])
            return r.choice([b"\x91", b"\x81\xa1a", b"\xdc\x00\x01"]) * depth + b"\xc0"
        if kind == "mutated":
            return self.mutate(self.sealer.seal(self.valid())[0])
        if kind == "replay" and self.captured:
            return r.choice(self.captured)
        if kind == "sealed_junk":  # what a key holder could send: a MAC over junk
            env = auth.Envelope(ts_ms=int(time.time() * 1000), nonce=r.randbytes(16),
                                payload=self.mutate(m.encode(self.valid())))
            if self.key is not None:
                env.mac = auth._mac(self.key, b"Q", env)
            return auth._env_encoder.encode(env)
        if kind == "wrong_key":
            return auth.Authenticator(b"w" * 32).seal(self.valid())[0]
        wire = self.sealer.seal(self.valid())[0]  # "forged": well-formed, wrong capability
        if len(self.captured) < 200:
            self.captured.append(wire)
        return wire

    def send(self, data: bytes) -> None:
        self.sock.send(data)
        assert self.sock.poll(REPLY_TIMEOUT_MS, zmq.POLLIN), (
            f"prefill did not answer a {len(data)}-byte fuzz message starting {data[:32]!r}"
        )
        raw = self.sock.recv()
        try:
            reply = self.opener.open_reply(raw, None)
        except ValueError:  # a reply sealed for a request it could not read: no MAC check
            reply = auth.Authenticator(None).open_reply(raw, None)
        self.replies[type(reply).__name__] += 1
        if isinstance(reply, m.PrefillDone):
            self.held[reply.request_id] = reply.capability
        elif not isinstance(reply, m.Meta | m.Stats):
            assert len(raw) < MAX_ECHO, f"a {type(reply).__name__} reply of {len(raw)} bytes"

    def release_held(self, addr: tuple[str, int]) -> None:
        client = SideChannelClient(*addr, timeout_s=20.0, key=self.key)
        for rid, cap in self.held.items():
            with contextlib.suppress(ValueError):  # already freed (lease, or a fuzzed
                client.call(m.Release(request_id=rid, capability=cap))  # Release got it)
        self.held.clear()


def honest(decode: DecodeWorker, addr: tuple[str, int], key: bytes | None, rid: str,
           seed: int) -> bool:
    done = SideChannelClient(*addr, timeout_s=20.0, key=key).call(
        m.PrefillRequest(request_id=rid, num_tokens=100, seed=seed))
    assert isinstance(done, m.PrefillDone)
    res = decode.start(rid, addr, done.block_ids, capability=done.capability)
    if res.status == "pending":
        res = decode.wait(rid, 20.0)
    ok = res.ok and verify_request(decode.cache, res.local_block_ids, seed) == []
    if res.ok:
        decode.finish(rid)
    return ok


@pytest.mark.timeout(int(2 * FUZZ_S) + 240)
@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_fuzz_live_prefill_then_honest_decode_is_exact_and_nothing_leaks(keyed: bool) -> None:
    key = KEY if keyed else None
    # the victim is held through the whole fuzz: its lease must outlast it
    proc = PrefillProcess(LAYOUT, transport="nixl", lease_s=2 * FUZZ_S + 60, key=key)
    try:
        addr = proc.wait_ready()
        with make_decode(LAYOUT, transport="nixl", read_timeout_s=15.0,
                         handshake_timeout_s=20.0, key=key) as decode:
            fuzz = Fuzzer(addr, key, seed=1300 + keyed)
            # a request the honest decode holds while the fuzz forges at it
            victim = SideChannelClient(*addr, timeout_s=20.0, key=key).call(
                m.PrefillRequest(request_id="victim", num_tokens=200, seed=7))
            assert isinstance(victim, m.PrefillDone)
            fuzz.victims.append("victim")
            sent, honest_ok, honest_n = 0, 0, 0
            end = time.monotonic() + FUZZ_S
            try:
                while time.monotonic() < end:
                    fuzz.send(fuzz.one())
                    sent += 1
                    if len(fuzz.held) > 4:  # what the fuzz got held: give it back
                        fuzz.release_held(addr)
                    if sent % 200 == 0:
                        honest_n += 1
                        honest_ok += honest(decode, addr, key, f"h{honest_n}", seed=honest_n)
            finally:
                fuzz.close()
            assert proc.proc.is_alive()
            res = decode.start("victim", addr, victim.block_ids, capability=victim.capability)
            if res.status == "pending":
                res = decode.wait("victim", 20.0)
            assert res.ok and verify_request(decode.cache, res.local_block_ids, 7) == []
            decode.finish("victim")
            honest_n += 1
            honest_ok += honest(decode, addr, key, "h-last", seed=99)
            fuzz.release_held(addr)
            # the last READs' completions arrive as NIXL notifications, asynchronously
            s = wait_prefill_free(addr, NB, 20.0, key=key)
            print(f"\nfuzz {'with' if keyed else 'without'} a key: {sent} messages in "
                  f"{FUZZ_S:.0f} s, kinds {dict(fuzz.kinds)}, replies {dict(fuzz.replies)}; "
                  f"honest {honest_ok}/{honest_n} byte-exact (+ the victim); prefill "
                  f"unauthorized={s.unauthorized} bad_capability={s.bad_capability} "
                  f"prefilled={s.prefilled} completed={s.completed} released={s.released} "
                  f"expired={s.expired}")
            assert honest_ok == honest_n >= 1
            assert s.completed == honest_n + 1  # only the honest READs completed anything
            assert s.bad_capability > 0
            assert (s.unauthorized > 0) == keyed
    finally:
        proc.stop()
