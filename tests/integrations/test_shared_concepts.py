"""One implementation per P/D concept: the vLLM connector runs `kvstage.pd`'s.

Read from the source (ast, no vLLM needed): the connector's modules use pd's roles for the
handshake, the lease and its heartbeat, the READ and late bytes (`pd.prefill`,
`pd.decode`), `pd.prompt_saves` for the prefill's saves, the side channel's protocol
version for the params entry, `pd.auth` for keys and capabilities, and the roles' one host
buffer type; none of them holds a second implementation (HMAC, digests, a zmq socket,
msgspec messages, NIXL calls, run-finding, a host buffer or handshake of its own) or
assigns anything of vLLM's at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

VLLM_DIR = Path(__file__).parents[2] / "src" / "kvstage" / "integrations" / "vllm"


def _tree(name: str) -> ast.Module:
    return ast.parse((VLLM_DIR / name).read_text(), filename=name)


def _imports(name: str) -> set[str]:
    """``module`` and ``module.name`` of every import in ``name``."""
    out: set[str] = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


MODULES = sorted(p.name for p in VLLM_DIR.glob("*.py"))


@pytest.mark.parametrize(("module", "shared"), [
    # the handshake, the lease and its heartbeat, the READ, late bytes: pd's two roles
    ("worker.py", "kvstage.pd.prefill.PrefillWorker"),
    ("loads.py", "kvstage.pd.decode.DecodeWorker"),
    # the prefill's save bookkeeping
    ("scheduler.py", "kvstage.pd.prompt_saves.PromptSaves"),
    # one wire version: the params entry carries the side channel's
    ("scheduler.py", "kvstage.pd.messages.PROTOCOL_VERSION"),
    # capabilities and keys
    ("metadata.py", "kvstage.pd.auth"),
    ("secure.py", "kvstage.pd.auth"),
    # the device side of the one host buffer type (the roles build `cache.HostBuffer`)
    ("worker.py", "kvstage.integrations.vllm.copies.wrap_vllm_caches"),
    ("copy_op.py", "kvstage.plan.find_runs"),
])
def test_the_connector_imports_the_shared_piece(module: str, shared: str) -> None:
    assert shared in _imports(module)


@pytest.mark.parametrize("module", MODULES)
def test_no_second_implementation(module: str) -> None:
    imports = _imports(module)
    # capabilities and MACs: pd.auth; digests: pd.integrity; the side channel's sockets
    # and messages: pd.side_channel / pd.messages; NIXL: kvstage.transport
    for lib in ("hmac", "xxhash", "zmq", "msgspec", "nixl", "nixl._api"):
        assert lib not in imports, (module, lib)
    tree = _tree(module)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    # no vLLM NIXL connector piece, no host buffer of its own, no handshake of its own
    assert not (names | attrs) & {"NixlConnector", "NixlConnectorWorker",
                                  "NixlConnectorScheduler", "HostBuffer", "handshake"}, module
    assert "diff" not in attrs  # run-finding (np.diff of ids): plan.find_runs
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    assert not {c for c in classes if "Lease" in c or "Handshake" in c}, module


def test_no_vllm_name_is_assigned_at_run_time() -> None:
    """No runtime replacement: nothing in the connector assigns an attribute of a vLLM
    module or class (``vllm.x.y = ...``, ``SomeVllmClass.method = ...``)."""
    for module in MODULES:
        tree = _tree(module)
        vllm_names = {a.asname or a.name for n in ast.walk(tree)
                      if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm")
                      for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    while isinstance(target, ast.Attribute):
                        target = target.value
                    assert not (isinstance(target, ast.Name) and target.id in vllm_names), \
                        (module, ast.unparse(node)[:80])
