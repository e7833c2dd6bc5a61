"""The soak's hostile client: a peer that holds the shared key and runs beside the honest
decode, trying to change the state of requests it does not own.

Contract: `Hostiles` keeps one `Hostile` per pair (its own side-channel clients and its
own transport agent of the pair's kind, handshaken with the key, so it can notify the
prefill through NIXL or the loopback registry). `Hostiles.maybe_attack(pair, rid)` is
called right after prefill held ``rid`` and before the honest decode starts it; for a
``--hostile-rate`` fraction of requests (its own random stream, so the soak's plan does
not shift) it tries, synchronously:

- ``release``: Release with a random token, and with none;
- ``acquire``: Acquire (lease renewal) with a random token;
- ``wrong_key``: a Release sealed with another key;
- ``replay``: the same sealed Release sent twice (with a key: refused as a replay);
- ``notif``: the completion notification through its own agent, with a random token
  and in the bare pre-capability form.

A side-channel attempt is *accepted* if the prefill answers anything but an
``Error(unauthorized)``; a notification (sent first, while the request is surely held) is
accepted unless the prefill counted it as a wrong capability within a bounded wait
(only the hostile makes wrong-capability attempts, so ``bad_capability`` must grow by
exactly the notifications sent). `report` gives tried/accepted per kind; the soak breaks
on any accepted attempt (and the honest request must still end as its fault says).

Thread rules: the soak's thread only.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import secrets
import time
import uuid
from collections import Counter
from typing import Any

from kvstage.cli.args import fraction
from kvstage.errors import PeerError, Unauthorized
from kvstage.pd import auth
from kvstage.pd import messages as m
from kvstage.pd.side_channel import SideChannelClient, send_raw
from kvstage.transport import make_transport
from kvstage.transport.base import Transport

KINDS = ("release", "acquire", "wrong_key", "replay", "notif")
NOTIF_WAIT_S = 10.0  # bound on waiting for the prefill to count a forged notification


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hostile-rate", type=fraction("--hostile-rate"), default=0.1,
                        help="fraction of requests a hostile client (holding the key) attacks "
                             "with forged Release/Acquire/notifications and replays (0: none)")


class Hostile:
    def __init__(self, address: tuple[str, int], key: bytes | None, transport: str) -> None:
        self.address = address
        self.key = key
        self.client = SideChannelClient(*address, timeout_s=20.0, key=key)
        self.sealer = auth.Authenticator(key)
        self.tried: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.transport: Transport = make_transport(transport, f"hostile-{uuid.uuid4().hex[:8]}")
        try:
            meta = self.client.call(m.GetMeta(engine_id=self.transport.name))
            assert isinstance(meta, m.Meta)
            self.peer = self.transport.add_peer(meta.agent_metadata)
        except BaseException:
            self.transport.close()
            raise

    def _stats(self) -> m.Stats:
        s = self.client.call(m.GetStats())
        assert isinstance(s, m.Stats)
        return s

    def _forge(self, kind: str, msg: m.Message) -> None:
        self.tried[kind] += 1
        try:
            self.client.call(msg)
        except PeerError as exc:
            if exc.remote_code == Unauthorized.code:
                return
            self.accepted[kind] += 1  # refused, but not for the right reason: report it
        else:
            self.accepted[kind] += 1

    def _raw(self, wire: bytes) -> m.Message:
        reply = send_raw(*self.address, wire, timeout_s=20.0)
        if reply is None:
            raise TimeoutError("prefill did not answer the hostile client")
        return auth.Authenticator(None).open_reply(reply, None)

    def attack(self, rid: str) -> None:
        wrong = secrets.token_bytes(auth.TOKEN_BYTES)
        # notifications first, while the request is surely held (a forged Release that
        # got through would turn them into "unknown" ones)
        before = self._stats().bad_capability
        notifs = (auth.completion_notif(rid, wrong), rid.encode())
        for notif in notifs:
            self.tried["notif"] += 1
            self.transport.send_notif(self.peer, notif)
        deadline = time.monotonic() + NOTIF_WAIT_S
        while (counted := self._stats().bad_capability - before) < len(notifs):
            if time.monotonic() > deadline:  # not refused where it was due: accepted
                self.accepted["notif"] += len(notifs) - counted
                break
            time.sleep(0.002)
        self._forge("release", m.Release(request_id=rid, capability=wrong))
        self._forge("release", m.Release(request_id=rid))
        self._forge("acquire", m.Acquire(request_id=rid, capability=wrong))
        # sealed with another key: the reply is read unverified, so an acceptance shows
        other = auth.Authenticator(secrets.token_bytes(32))
        self.tried["wrong_key"] += 1
        reply = self._raw(other.seal(m.Release(request_id=rid, capability=wrong))[0])
        if not (isinstance(reply, m.Error) and reply.code == Unauthorized.code):
            self.accepted["wrong_key"] += 1
        wire, _ = self.sealer.seal(m.Release(request_id=rid, capability=wrong))
        for _ in range(2):  # the first is refused by its capability, the second as a replay
            self.tried["replay"] += 1
            reply = self._raw(wire)
            if not (isinstance(reply, m.Error) and reply.code == Unauthorized.code):
                self.accepted["replay"] += 1

    def close(self) -> None:
        self.transport.close()


class Hostiles:
    """One `Hostile` per pair, attacking a ``rate`` fraction of requests."""

    def __init__(self, rate: float, seed: int, key: bytes | None) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.key = key
        self.by_pair: dict[str, Hostile] = {}

    def add(self, pair: str, address: tuple[str, int], transport: str) -> None:
        if self.rate > 0:
            self.by_pair[pair] = Hostile(address, self.key, transport)

    def maybe_attack(self, pair: str, rid: str) -> None:
        hostile = self.by_pair.get(pair)
        if hostile is not None and self.rng.random() < self.rate:
            hostile.attack(rid)

    def close(self) -> None:
        for h in self.by_pair.values():
            with contextlib.suppress(Exception):
                h.close()

    def report(self) -> dict[str, Any]:
        tried: Counter[str] = Counter()
        accepted: Counter[str] = Counter()
        for h in self.by_pair.values():
            tried.update(h.tried)
            accepted.update(h.accepted)
        return {
            "rate": self.rate,
            "tried": {k: tried[k] for k in KINDS},
            "accepted": {k: accepted[k] for k in KINDS},
            "forged_accepted": sum(accepted.values()),
            "forged_tried": sum(tried.values()),
        }
