"""One implementation per P/D concept (issue 25): the vLLM connector calls `kvstage.pd`'s.

Read from the source (ast, no vLLM needed): the connector's modules import the shared
pieces (capabilities from `pd.auth`, the side-channel sockets from `pd.side_channel`,
digests and their pairing from `pd.integrity` / `pd.reads`, runs from `plan`, the lease
decision from `pd.lease`), and none of them holds a second implementation (HMAC, a zmq
socket or ROUTER loop of its own, digest hashing, run-finding, a swap of a vLLM global).
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
    ("secure.py", "kvstage.pd.auth"),
    ("secure_handshake.py", "kvstage.pd.auth.Authenticator"),
    ("secure_handshake.py", "kvstage.pd.side_channel.SideChannelServer"),
    ("secure_handshake.py", "kvstage.pd.side_channel.SideChannelClient"),
    ("checksums.py", "kvstage.pd.integrity.from_params"),
    ("checksums.py", "kvstage.pd.integrity.to_params"),
    ("checksums.py", "kvstage.pd.integrity.mismatches"),
    ("checksums.py", "kvstage.pd.reads.pair_blocks"),
    ("copy_op.py", "kvstage.plan.find_runs"),
    ("lease.py", "kvstage.pd.lease"),
])
def test_the_connector_imports_the_shared_piece(module: str, shared: str) -> None:
    assert shared in _imports(module)


def test_the_shared_pieces_are_called() -> None:
    """Imported and used: the names the connector calls for each concept."""
    called = {
        "secure.py": {"derived_capability", "same_capability", "parse_notif"},
        "secure_handshake.py": {"SideChannelServer", "SideChannelClient", "poll_raw",
                                "send_frames", "exchange"},
        "checksums.py": {"from_params", "to_params", "mismatches", "pair_blocks"},
        "copy_op.py": {"find_runs"},
        "lease.py": {"read_refusal", "time_left"},
    }
    for module, names in called.items():
        seen = {n.attr if isinstance(n, ast.Attribute) else n.id
                for c in ast.walk(_tree(module)) if isinstance(c, ast.Call)
                for n in [c.func] if isinstance(n, ast.Attribute | ast.Name)}
        assert names <= seen, (module, sorted(names - seen))


@pytest.mark.parametrize("module", MODULES)
def test_no_second_implementation(module: str) -> None:
    imports = _imports(module)
    assert "hmac" not in imports  # capabilities and MACs: pd.auth
    assert "xxhash" not in imports  # digests: pd.integrity
    tree = _tree(module)
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    called = {c.func.attr for c in ast.walk(tree)
              if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)}
    # no zmq socket of its own, no ROUTER loop: kvstage's sockets are pd.side_channel's
    assert not called & {"Context", "socket", "bind", "bind_to_random_port", "connect",
                         "poll", "recv", "recv_multipart"}
    assert "diff" not in attrs  # run-finding (np.diff of ids): plan.find_runs
    assert "hexdigest" not in attrs or module == "vllm_code.py"  # the pinned source digest
    assert "base_worker" not in names | attrs  # no swap of vLLM's handshake globals
    # the digests' JSON form is pd.integrity's (request_params.py calls to_params)
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert "xxh3_64" not in literals


def test_no_vllm_module_global_is_assigned() -> None:
    """The sealed handshake rebinds ``zmq_ctx`` in a private copy of globals only."""
    for module in MODULES:
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    assert not (isinstance(target, ast.Attribute)
                                and target.attr == "zmq_ctx"), module
