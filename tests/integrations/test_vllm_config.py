"""`integrations.vllm.config.KVStageConfig`: every connector setting parsed once, exactly:
defaults, each key's value, one line per bad value naming key, value and range (all in one
error), unknown and removed ``kvstage_*`` keys refused with the known list, and the
docs/connector.md's table equal to `KEYS`."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstage.integrations.vllm.config import KEYS, KNOWN, KVStageConfig


def test_defaults() -> None:
    assert KVStageConfig.parse(None) == KVStageConfig(
        key_file=None, allow_unauthenticated=False,
        verify_checksum=False, progress_delay_us=20_000, log_reads=False,
        lease_duration_s=30.0)


def test_every_key() -> None:
    cfg = KVStageConfig.parse({
        "kvstage_key_file": "/k", "kvstage_log_reads": True,
        "kvstage_allow_unauthenticated": True, "kvstage_verify_checksum": True,
        "kvstage_progress_delay_us": 0, "kv_lease_duration": 6, "kv_recompute_threshold": 3,
        "kvstage_save_by_chunk": False, "kvstage_time_hooks": True,
    })
    assert cfg == KVStageConfig(
        key_file="/k", allow_unauthenticated=True,
        verify_checksum=True, progress_delay_us=0, log_reads=True, lease_duration_s=6.0,
        save_by_chunk=False, time_hooks=True)
    with pytest.raises(AttributeError):
        cfg.log_reads = False  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("kvstage_log_reads", "yes", "true or false"),
    ("kvstage_verify_checksum", 1, "true or false"),
    ("kvstage_key_file", 3, "a path string"),
    ("kvstage_progress_delay_us", 100_001, "an int 0..100000"),
    ("kvstage_progress_delay_us", 1.5, "an int 0..100000"),
    ("kv_lease_duration", math.inf, "a number of seconds > 0"),
    ("kv_lease_duration", 0, "a number of seconds > 0"),
    ("kv_lease_duration", "30", "a number of seconds > 0"),
])
def test_a_bad_value_is_one_line_naming_key_value_and_range(key: str, value: Any,
                                                            expected: str) -> None:
    with pytest.raises(ValueError) as info:
        KVStageConfig.parse({key: value})
    assert str(info.value).startswith(
        f"KVStageConnector: kv_connector_extra_config {key}={value!r}: expected {expected}")
    assert "\n" not in str(info.value)


def test_every_bad_value_at_once_and_vllm_settings() -> None:
    with pytest.raises(ValueError) as info:
        KVStageConfig.parse({"kvstage_log_reads": "no", "kvstage_merge_reads": False,
                             "kvstage_verfy_checksum": True, "kvstage_verify_checksum": True},
                            kv_buffer_device="cuda", permute_local_kv=True)
    lines = str(info.value).removeprefix("KVStageConnector: ").split("\n")
    assert lines == [
        "kv_connector_extra_config kvstage_log_reads='no': expected true or false",
        "kv_connector_extra_config kvstage_merge_reads=False: kvstage_merge_reads was "
        "removed: a READ posts one descriptor per run of blocks already; drop the key",
        "kv_connector_extra_config kvstage_verfy_checksum=True: unknown kvstage key; known: "
        + ", ".join(KNOWN),
        "kv_buffer_device='cuda': expected 'cpu' (KVStageConnector stages KV through host "
        "memory; use NixlConnector for device-to-device)",
        "enable_permute_local_kv=True: expected false (vLLM's heterogeneous-TP permute is "
        "NixlConnector's; KVStageConnector does not use it)",
    ]


@pytest.mark.parametrize("key", ["kvstage_quiet_poll_ms", "kvstage_lease_margin_s",
                                 "kvstage_force_host_buffer"])
def test_removed_keys_say_why(key: str) -> None:
    with pytest.raises(ValueError, match=f"{key}=1: {key} was removed: .*; drop the key$"):
        KVStageConfig.parse({key: 1})


def test_from_vllm_reads_the_config_by_attribute() -> None:
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"kvstage_log_reads": True},
            kv_buffer_device="cpu", enable_permute_local_kv=False),
        parallel_config=SimpleNamespace(world_size=1))
    assert KVStageConfig.from_vllm(vllm_config) == KVStageConfig(log_reads=True)


def test_connector_reference_table_is_the_keys() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "connector.md").read_text()
    rows = re.findall(r"^\| `(kv[a-z_]+)` \| (.+?) \| (.+?) \| (.+?) \| (.+?) \|$", readme,
                      re.MULTILINE)
    table = [r for r in rows if r[0] in {k for k, *_ in KEYS}]
    assert [(k, t, d.strip("`"), r, m) for k, t, d, r, m in table] == list(KEYS)
