"""`integrations.vllm.request_params`: the one versioned schema of what a prefill hands a
decode per request, exactly: the wire form, round trips, packing the feature modules' keys,
and a one-line refusal for every malformed value."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kvstage.integrations.vllm import request_params as rp
from kvstage.integrations.vllm.request_params import RequestParams


def test_wire_form_and_round_trip() -> None:
    value = RequestParams(lease_expires=12.5, checksums={7: 0xABC, 0: 1}).encode()
    assert value == {"v": 1, "lease_expires": 12.5,
                     "checksums": {"xxh3_64": {"7": "0000000000000abc", "0": "0000000000000001"}}}
    assert rp.decode(json.loads(json.dumps(value))) == RequestParams(
        lease_expires=12.5, checksums={7: 0xABC, 0: 1})
    assert RequestParams().encode() == {"v": 1}
    assert rp.decode(None) == RequestParams()
    assert rp.decode({"v": 1, "lease_expires": 3}) == RequestParams(lease_expires=3.0)
    both = RequestParams(lease_expires=3.0, lease_extension_s=4.0)
    assert both.encode() == {"v": 1, "lease_expires": 3.0, "lease_extension_s": 4.0}
    assert rp.decode(both.encode()) == both


def test_pack_moves_the_feature_keys_into_one() -> None:
    params: dict[str, Any] = {"do_remote_prefill": True, "kvstage_lease_expires": 9.0,
                              "kvstage_lease_extension_s": 4.0}
    rp.pack(params)
    assert params == {"do_remote_prefill": True, "kvstage": {
        "v": 1, "lease_expires": 9.0, "lease_extension_s": 4.0}}
    params["kvstage_checksums"] = {"xxh3_64": {"3": "00000000000000ff"}}  # filled later
    rp.pack(params)
    assert params == {"do_remote_prefill": True, "kvstage": {
        "v": 1, "lease_expires": 9.0, "lease_extension_s": 4.0,
        "checksums": {"xxh3_64": {"3": "00000000000000ff"}}}}
    untouched: dict[str, Any] = {"do_remote_prefill": True}
    rp.pack(untouched)
    rp.pack(None)
    assert untouched == {"do_remote_prefill": True}


@pytest.mark.parametrize(("value", "message"), [
    ([1], "kv_transfer_params['kvstage'] =[1]: expected an object {\"v\": 1, ...}"),
    ({"v": 2}, "kv_transfer_params['kvstage'] v=2: expected version 1 (the decode runs "
               "kvstage protocol 1; run one kvstage version on both instances)"),
    ({"lease_expires": 1.0}, "kv_transfer_params['kvstage'] v=None: expected version 1"),
    ({"v": 1, "extra": 1}, "kv_transfer_params['kvstage'] extra=1: expected one of v, "
                           "lease_expires, lease_extension_s, checksums"),
    ({"v": 1, "lease_extension_s": -1}, "lease_extension_s=-1: expected a finite number of "
                                        "seconds >= 0"),
    ({"v": 1, "lease_extension_s": math.inf}, "lease_extension_s=inf: expected a finite"),
    ({"v": 1, "lease_expires": "9"}, "lease_expires='9': expected a finite number"),
    ({"v": 1, "lease_expires": math.nan}, "lease_expires=nan: expected a finite number"),
    ({"v": 1, "lease_expires": True}, "lease_expires=True: expected a finite number"),
    ({"v": 1, "checksums": {"md5": {}}}, "checksums={'md5': {}}: expected {\"xxh3_64\""),
    ({"v": 1, "checksums": {"xxh3_64": {"x": "00000000000000ff"}}},
     "checksums={'x': '00000000000000ff'}: expected decimal block ids to 16 hex digits"),
    ({"v": 1, "checksums": {"xxh3_64": {"1": "ff"}}},
     "checksums={'1': 'ff'}: expected decimal block ids to 16 hex digits"),
])
def test_malformed_values_are_refused_in_one_line(value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        rp.decode(value)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_sizes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rp, "MAX_BLOCKS", 2)
    rows = {str(b): "0" * 16 for b in range(3)}
    with pytest.raises(ValueError, match=r"checksums='<3 blocks>': expected at most 2 blocks"):
        rp.decode({"v": 1, "checksums": {"xxh3_64": rows}})
    long = rp.decode.__globals__["_refuse"]("x", "y" * 500, "z")
    assert len(str(long)) < 150  # what arrived is shown cut
