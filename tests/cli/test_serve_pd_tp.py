"""`kvstage serve-pd --prefill-tp N --decode-tp N`: what each instance of a tensor-parallel
deployment is given (cores per rank, GPUs, side-channel ports), exactly; no vLLM needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstage.serving import TINY_CPU_ENGINE_ARGS, PDCluster, ServingError
from kvstage.serving.placement import gpu_assignment, omp_threads_bind, place_ranks
from tests.cli.test_serve_pd import _dry


def test_place_ranks() -> None:
    # TP 1 everywhere: the instances' split (prefills share core 0 on 2 cores)
    assert place_ranks([0, 1], 2, 1) == [((0,),), ((0,),), ((1,),)]
    # a core per rank or more: consecutive chunks
    assert place_ranks([0, 1, 2, 3], 1, 1, 2, 2) == [((0,), (1,)), ((2,), (3,))]
    assert place_ranks(list(range(8)), 1, 1, 2, 2) == [((0, 1), (2, 3)), ((4, 5), (6, 7))]
    # fewer cores than ranks: each instance gets all of them, its ranks unbound
    assert place_ranks([0, 1], 1, 1, 2, 2) == [((0, 1), (0, 1)), ((0, 1), (0, 1))]
    assert place_ranks([5], 1, 1, 2, 2) == [((5,), (5,)), ((5,), (5,))]


def test_omp_threads_bind() -> None:
    assert omp_threads_bind(((0,), (1,))) == ("0|1", 1)
    assert omp_threads_bind(((0, 1), (2, 3))) == ("0,1|2,3", 2)
    assert omp_threads_bind(((3,),)) == ("3", 1)
    # ranks sharing a core are left to the kernel: one OpenMP thread each
    assert omp_threads_bind(((0, 1), (0, 1))) == ("nobind", 1)
    assert omp_threads_bind(((5,), (5,))) == ("nobind", 1)


def test_cluster_at_tp2_on_two_cores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    c = PDCluster(model="/m", num_prefill=2, num_decode=1, prefill_tp=2, decode_tp=2,
                  log_dir=tmp_path, device="cpu", engine_args=TINY_CPU_ENGINE_ARGS)
    taken: set[int] = set()
    for inst in c.instances:
        argv = inst.argv
        assert argv[:3] == ["taskset", "-c", "0,1"]
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert inst.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # 4 ranks on 2 cores
        assert inst.env["OMP_NUM_THREADS"] == "1"
        assert inst.side_channel_port is not None
        ranks = {inst.side_channel_port, inst.side_channel_port + 1}  # rank r: port + r
        assert not ranks & taken
        taken |= ranks


def test_cluster_at_tp1_passes_no_tp_flag(tmp_path: Path) -> None:
    c = PDCluster(model="/m", log_dir=tmp_path, device="cpu")
    assert all("--tensor-parallel-size" not in i.argv for i in c.instances)


def test_cluster_tp_bounds(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tensor-parallel sizes must be 1..64, got prefill 0"):
        PDCluster(model="/m", log_dir=tmp_path, device="cpu", prefill_tp=0)


def test_gpus_per_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert gpu_assignment(2, tps=[2, 2]) == ["4,5", "6,7"]
    c = PDCluster(model="/m", prefill_tp=2, decode_tp=2, log_dir=tmp_path, device="cuda")
    assert [i.env["CUDA_VISIBLE_DEVICES"] for i in c.instances] == ["4,5", "6,7"]
    assert all(i.argv[i.argv.index("--tensor-parallel-size") + 1] == "2" for i in c.instances)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ServingError, match=r"2 api_servers need 4 GPUs, 3 visible \(4,5,6\)"):
        gpu_assignment(2, tps=[2, 2])
    assert gpu_assignment(2, tps=[2, 2], share=True) == ["4,5", "6,4"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    with pytest.raises(ServingError, match="tensor-parallel size 2 needs 2 GPUs per instance"):
        gpu_assignment(1, tps=[2], share=True)


def test_role_prefill_at_tp2_takes_a_port_per_rank(
        model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _dry(capsys, "--model", str(model_dir), "--role", "prefill", "--prefill",
                        "2", "--prefill-tp", "2", "--device", "cpu", "--port", "8100")
    assert rc == 0, err
    lines = [x for x in out.splitlines() if x.strip().startswith("$ ")]
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={5600 + 2 * i}" in line
        assert "--tensor-parallel-size 2" in line
        kv = json.loads(line.split("--kv-transfer-config ", 1)[1].strip("'"))
        assert kv["kv_role"] == "kv_producer"


def test_cluster_across_tp_sizes_tells_each_side_the_others(tmp_path: Path) -> None:
    """P TP 2 / D TP 1: the prefills cut their pages for decode TP 1, the decodes read
    prefills at TP 2 (kvstage_peer_tp_size), the user's extra config kept."""
    c = PDCluster(model="/m", num_prefill=1, num_decode=2, prefill_tp=2, decode_tp=1,
                  log_dir=tmp_path, device="cpu", extra_kv_config={"kvstage_log_reads": True})
    peers = []
    for inst in c.instances:
        kv = json.loads(inst.argv[inst.argv.index("--kv-transfer-config") + 1])
        extra = kv["kv_connector_extra_config"]
        assert extra["kvstage_log_reads"] is True
        peers.append((kv["kv_role"], extra["kvstage_peer_tp_size"]))
    assert peers == [("kv_producer", 1), ("kv_consumer", 2), ("kv_consumer", 2)]
    same = PDCluster(model="/m", prefill_tp=2, decode_tp=2, log_dir=tmp_path, device="cpu")
    for inst in same.instances:
        kv = json.loads(inst.argv[inst.argv.index("--kv-transfer-config") + 1])
        assert "kvstage_peer_tp_size" not in kv.get("kv_connector_extra_config", {})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_role_across_tp_sizes_names_the_other_side(
        model_dir: Path, capsys: pytest.CaptureFixture[str], role: str) -> None:
    rc, out, err = _dry(capsys, "--model", str(model_dir), "--role", role, "--prefill-tp", "2",
                        "--decode-tp", "1", "--device", "cpu", "--port", "8100")
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.strip().startswith("$ "))
    kv = json.loads(line.split("--kv-transfer-config '", 1)[1].split("'")[0])
    assert kv["kv_connector_extra_config"]["kvstage_peer_tp_size"] == (
        1 if role == "prefill" else 2)


@pytest.mark.parametrize(("args", "needle"), [
    (["--prefill-tp", "2", "--decode-tp", "1", "--connector", "nixl"],
     "--prefill-tp 2 and --decode-tp 1 differ: serve-pd maps different sizes with "
     "--connector kvstage only"),
    (["--prefill-tp", "0"], "--prefill-tp must be > 0 and <= 64, got 0"),
    (["--decode-tp", "x"], "--decode-tp must be an integer, got 'x'"),
])
def test_tp_refusals_one_line_exit_2(model_dir: Path, args: list[str], needle: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _dry(capsys, "--model", str(model_dir), "--device", "cpu", *args)
    assert rc == 2 and needle in err.strip().splitlines()[-1], err
