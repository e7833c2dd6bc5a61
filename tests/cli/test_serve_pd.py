"""`kvstage serve-pd` / `kvstage.serving` without vLLM: argument refusals, the command
lines and environment each instance gets, core splits, and process-group stop/kill on
a real child process (a sleeping shell standing in for nothing: the group semantics are
the thing under test)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from kvstage.cli import main as cli_main
from kvstage.serving import TINY_CPU_ENGINE_ARGS, Instance, PDCluster, ServingError
from kvstage.serving.cluster import connector_config, split_cores


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """(exit code, stderr) of ``kvstage *args`` run in this process."""
    try:
        rc = cli_main(list(args))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize(("args", "needle"), [
    (["--model", "/no/such/dir"], "--model '/no/such/dir' is not a directory"),
    (["--prefill", "0"], "--prefill must be > 0 and <= 16, got 0"),
    (["--decode", "x"], "--decode must be an integer, got 'x'"),
    (["--port", "70000"], "--port must be > 0 and <= 65535, got 70000"),
    (["--connector", "lmcache"], "invalid choice: 'lmcache'"),
    (["--kv-load-failure-policy", "retry"], "invalid choice: 'retry'"),
])
def test_bad_arguments_one_line_exit_2(model_dir: Path, args: list[str], needle: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    full = args if args[0] == "--model" else ["--model", str(model_dir), *args]
    rc, err = _cli(capsys, "serve-pd", *full)
    assert rc == 2
    assert needle in err.splitlines()[-1]


def test_model_dir_without_config_refused(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "serve-pd", "--model", str(tmp_path))
    assert rc == 2
    assert "has no config.json" in err


def test_busy_port_refused(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc, err = _cli(capsys, "serve-pd", "--model", str(model_dir), "--port",
                       str(s.getsockname()[1]))
    assert rc == 2
    assert "is not free on 127.0.0.1" in err


def test_split_cores() -> None:
    assert split_cores([0, 1], 2, 1) == [(0,), (0,), (1,)]
    assert split_cores([0, 1], 1, 2) == [(0,), (1,), (1,)]
    assert split_cores([0, 1], 1, 1) == [(0,), (1,)]
    assert split_cores([0, 1, 2, 3, 4, 5, 6, 7], 2, 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert split_cores([3], 2, 2) == [(3,)] * 4


def test_cluster_command_lines(tmp_path: Path) -> None:
    c = PDCluster(model="/m", num_prefill=2, num_decode=1, log_dir=tmp_path, device="cpu",
                  kv_load_failure_policy="recompute", extra_kv_config={"x": 1})
    names = [i.name for i in c.instances]
    assert names == ["prefill0", "prefill1", "decode0"]
    ports = {i.port for i in c.instances} | {i.side_channel_port for i in c.instances}
    assert len(ports) == 6  # distinct HTTP and side-channel ports
    for inst in c.instances:
        argv = inst.argv
        assert argv[:2] == ["taskset", "-c"]
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "KVStageConnector"
        assert kv["kv_role"] == ("kv_producer" if inst.role == "prefill" else "kv_consumer")
        assert kv["kv_load_failure_policy"] == "recompute"
        assert kv["kv_connector_extra_config"] == {"kvstage_force_host_buffer": True, "x": 1}
        assert inst.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(inst.side_channel_port)
        assert inst.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert inst.env["VLLM_CPU_OMP_THREADS_BIND"] == argv[2]
        assert " ".join(TINY_CPU_ENGINE_ARGS.argv()) in " ".join(argv)


def test_cuda_config_is_the_host_path_unforced() -> None:
    cfg = connector_config("kvstage", "kv_consumer", device="cuda", policy="fail")
    assert cfg == {"kv_connector": "KVStageConnector",
                   "kv_connector_module_path": "kvstage.integrations.vllm",
                   "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
                   "kv_load_failure_policy": "fail"}
    assert connector_config("none", "kv_both", device="cpu", policy="fail") is None


def _shell_instance(tmp_path: Path, script: str) -> Instance:
    return Instance(name="sh", role="single", argv=["sh", "-c", script], port=1,
                    log_path=tmp_path / "sh.log")


def test_stop_kills_the_whole_group(tmp_path: Path) -> None:
    # the leader ignores SIGTERM and has a child: stop() must still end both
    child_file = tmp_path / "child"
    inst = _shell_instance(tmp_path, f"trap '' TERM; sleep 300 & echo $! > {child_file}; wait")
    inst.spawn()
    deadline = time.monotonic() + 10
    while not child_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(child_file.read_text())
    inst.stop(grace=0.5)
    assert not inst.alive
    # SIGKILL is delivered asynchronously: the child is gone (or a zombie) within a bound
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_wait_ready_fails_with_log_tail_when_the_child_exits(tmp_path: Path) -> None:
    inst = _shell_instance(tmp_path, "echo engine said no; exit 3")
    inst.spawn()
    with pytest.raises(ServingError, match=r"(?s)exited \(rc=3\).*engine said no"):
        inst.wait_ready(timeout=10)
    assert not inst.alive
