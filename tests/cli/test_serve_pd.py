"""`kvstage serve-pd` / `kvstage.serving` without vLLM: argument refusals, the command
lines and environment each instance gets, core splits, and process-group stop/kill on
a real child process (a sleeping shell standing in for nothing: the group semantics are
the thing under test)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from kvstage.cli import main as cli_main
from kvstage.serving import TINY_CPU_ENGINE_ARGS, Instance, PDCluster, ServingError
from kvstage.serving.cluster import connector_config
from kvstage.serving.engine_args import DEFAULT_ENGINE_ARGS, with_user_flags
from kvstage.serving.placement import gpu_assignment, split_cores


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """(exit code, stderr) of ``kvstage *args`` run in this process."""
    try:
        rc = cli_main(list(args))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


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
                  kv_load_failure_policy="recompute", extra_kv_config={"x": 1},
                  engine_args=TINY_CPU_ENGINE_ARGS)
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
        assert kv["kv_connector_extra_config"] == {"x": 1}
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


# -- issue 26: the user's api_server flags, connector options, GPU placement -----------------
@pytest.mark.parametrize(("flags", "needle"), [
    (["--port", "9000"], "api_server flag --port is set by kvstage for each instance"),
    (["--kv-transfer-config={}"], "api_server flag --kv-transfer-config is set by kvstage"),
    (["--host", "0.0.0.0"], "api_server flag --host is set by kvstage"),
    (["--model=x"], "api_server flag --model is set by kvstage"),
])
def test_clashing_api_server_flags_refused(model_dir: Path, flags: list[str], needle: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "serve-pd", "--model", str(model_dir), "--", *flags)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1
    assert needle in err and "remove it from the flags after --" in err


def test_user_flags_replace_the_defaults_of_their_name() -> None:
    args = with_user_flags(TINY_CPU_ENGINE_ARGS, ["--max-model-len", "1024",
                                                  "--enable-prefix-caching", "--dtype=bfloat16"])
    argv = args.argv()
    assert argv.count("--max-model-len") == 1
    assert argv[argv.index("--max-model-len") + 1] == "1024"
    assert "--no-enable-prefix-caching" not in argv and argv.count("--enable-prefix-caching") == 1
    assert "--dtype=bfloat16" in argv and "--dtype" not in argv
    assert argv.count("--block-size") == 1  # the defaults not named stay
    assert with_user_flags(DEFAULT_ENGINE_ARGS, []).argv() == []


@pytest.mark.parametrize(("arg", "needle"), [
    (["--kv-extra", "novalue"], "--kv-extra expects KEY=VALUE"),
    (["--kv-extra", "bad key=1"], "--kv-extra expects KEY=VALUE"),
    (["--key-file", "/no/such/key"], "--key-file '/no/such/key' is not a readable file"),
])
def test_connector_option_refusals(model_dir: Path, arg: list[str], needle: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _cli(capsys, "serve-pd", "--model", str(model_dir), *arg)
    assert rc == 2 and needle in err.splitlines()[-1]


def test_kv_extra_values_are_json_or_text() -> None:
    from kvstage.cli.serve_pd import _kv_extra

    assert _kv_extra("kvstage_verify_checksum=true") == ("kvstage_verify_checksum", True)
    assert _kv_extra("kv_lease_duration=30") == ("kv_lease_duration", 30)
    assert _kv_extra("name=abc") == ("name", "abc")


def test_gpu_placement(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert gpu_assignment(3) == ["4", "5", "6"]
    c = PDCluster(model="/m", num_prefill=2, num_decode=1, log_dir=tmp_path, device="cuda")
    assert [i.env["CUDA_VISIBLE_DEVICES"] for i in c.instances] == ["4", "5", "6"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(ServingError, match=r"3 api_servers need 3 GPUs, 1 visible \(7\)"):
        PDCluster(model="/m", num_prefill=2, num_decode=1, log_dir=tmp_path, device="cuda")
    shared = PDCluster(model="/m", num_prefill=2, num_decode=1, log_dir=tmp_path,
                       device="cuda", share_gpus=True)
    assert [i.env["CUDA_VISIBLE_DEVICES"] for i in shared.instances] == ["7", "7", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ServingError, match="no GPU visible"):
        gpu_assignment(1)


def test_cluster_and_cli_share_one_set_of_defaults(tmp_path: Path) -> None:
    from kvstage.cli.serve_pd import ENGINE_DEFAULTS

    c = PDCluster(model="/m", log_dir=tmp_path, device="cpu")
    assert c.engine_args == ENGINE_DEFAULTS["vllm"] == DEFAULT_ENGINE_ARGS
    assert c.instances[0].env["VLLM_SSM_CONV_STATE_LAYOUT"] == "DS"


# -- issue 26: one host's part (--role), printed for the operator's own supervisor -----------
def _dry(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        rc = cli_main(["serve-pd", *args, "--dry-run"])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_role_prefill_on_a_routable_address(model_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTAGE_KEY", raising=False)
    for name in [k for k in os.environ if k.startswith("UCX_")]:  # a NIXL agent of another
        monkeypatch.delenv(name)  # test in this process sets them; serve-pd keeps the user's
    args = ["--model", str(model_dir), "--role", "prefill", "--prefill", "2",
            "--host", "10.9.8.7", "--port", "8100", "--device", "cpu"]
    rc, _, err = _dry(capsys, *args)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "--host 10.9.8.7 is reachable from other machines and no key is given" in err
    key = tmp_path / "key"
    key.write_text("k" * 44)
    rc, out, err = _dry(capsys, *args, "--key-file", str(key), "--kv-extra",
                        "kvstage_verify_checksum=true")
    assert rc == 0, err
    lines = [line for line in out.splitlines() if line.strip().startswith("$ ")]
    assert len(lines) == 2  # no router on a prefill host
    for i, line in enumerate(lines):
        assert f"--host 10.9.8.7 --port {8100 + i}" in line
        assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={5600 + i}" in line
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST=10.9.8.7" in line and "VLLM_HOST_IP=10.9.8.7" in line
        assert "UCX_NET_DEVICES=lo" not in line  # UCX picks the routable interface
        # the same off-loopback TCP settings as kvstage's own roles (ucx_env.choose)
        assert "UCX_TLS=tcp " in line and "UCX_TCP_TX_SEG_SIZE=64k" in line
        assert "UCX_TCP_RX_SEG_SIZE=256k" in line
        kv = json.loads(line.split("--kv-transfer-config ", 1)[1].strip("'"))
        assert kv["kv_role"] == "kv_producer"
        assert kv["kv_connector_extra_config"]["kvstage_key_file"] == str(key.resolve())
        assert kv["kv_connector_extra_config"]["kvstage_verify_checksum"] is True


def test_role_decode_on_loopback_needs_no_key(model_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _dry(capsys, "--model", str(model_dir), "--role", "decode", "--device",
                        "cpu", "--port", "8200", "--side-channel-port", "5700")
    assert rc == 0, err
    (line,) = [x for x in out.splitlines() if x.strip().startswith("$ ")]
    assert '"kv_role":"kv_consumer"' in line and "VLLM_NIXL_SIDE_CHANNEL_PORT=5700" in line
    assert "UCX_NET_DEVICES=lo" in line
    assert "UCX_TCP_TX_SEG_SIZE" not in line  # loopback: the bytes move by CMA


@pytest.mark.parametrize(("args", "needle"), [
    (["--role", "all", "--host", "10.0.0.1"], "--host is for --role prefill/decode/router"),
    (["--role", "prefill", "--prefill-url", "http://a:1"], "are for --role router"),
    (["--role", "router"], "--role router needs at least one --prefill-url and one"),
    (["--role", "router", "--prefill-url", "ftp://x", "--decode-url", "http://d:2"],
     "expected an instance URL like http://10.0.0.2:8100, got 'ftp://x'"),
    (["--role", "prefill", "--host", "bad host!"], "--host expects an address or host name"),
])
def test_role_refusals(model_dir: Path, args: list[str], needle: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _dry(capsys, "--model", str(model_dir), *args)
    assert rc == 2 and needle in err.strip().splitlines()[-1]


def test_role_router_in_front_of_other_hosts(model_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from kvstage.serving.cluster import router_executable

    try:
        router_executable()
    except ServingError:
        pytest.skip("needs vllm-router (`make test-vllm` installs it in .venv-vllm)")
    rc, out, err = _dry(capsys, "--model", str(model_dir), "--role", "router", "--host",
                        "10.0.0.3", "--port", "8000", "--prefill-url", "http://10.0.0.1:8100",
                        "--decode-url", "http://10.0.0.2:8200", "--decode-url",
                        "http://10.0.0.2:8201", "--router-arg=--health-check-interval-secs=5")
    assert rc == 0, err
    (line,) = [x for x in out.splitlines() if x.strip().startswith("$ ")]
    assert "--prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200 --decode " \
           "http://10.0.0.2:8201 --host 10.0.0.3 --port 8000" in line
    assert line.endswith("--health-check-interval-secs=5")


def test_nixl_on_cpu_says_it_is_for_comparisons(model_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _dry(capsys, "--model", str(model_dir), "--role", "prefill", "--device",
                      "cpu", "--connector", "nixl")
    assert rc == 0
    assert "for comparisons only" in err and "serve with --connector kvstage" in err
