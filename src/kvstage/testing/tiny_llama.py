"""A tiny, randomly initialised Llama (full attention only), built locally (no hub access).

Contract: `build_tiny_llama(path)` writes a HuggingFace checkpoint (config + safetensors) and
the word-level tokenizer of `tiny_gemma3.build_word_tokenizer` (same ids, same words), so
the two tiny models take the same prompts, text or ids. It is the NON-hybrid counterpart of
the tiny hybrid Gemma3: every layer full attention, one KV cache group, no aliasing between
groups, the case vLLM's own NIXL host path (one buffer per layer name) handles correctly;
the serving benchmark runs vLLM's NixlConnector on both. Shapes match the Gemma3's KV (4
layers, 1 KV head of 64, float32): the same bytes per block and layer. Weights come from a
fixed seed: two builds are byte-identical.

Needs ``transformers`` (vLLM pulls it); imported lazily so ``kvstage.testing`` does not.
"""

from __future__ import annotations

from pathlib import Path

from kvstage.testing.tiny_gemma3 import NUM_KV_HEADS, save_tiny_model, shared_config_kwargs


def build_tiny_llama(path: str | Path, *, seed: int = 0,
                     num_kv_heads: int = NUM_KV_HEADS) -> Path:
    """Write the tiny Llama to ``path`` (created if missing) and return it. 2 query heads;
    ``num_kv_heads`` 1 (default: replicated at tensor-parallel size 2) or 2 (split)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shared_config_kwargs(num_kv_heads=num_kv_heads),
                         tie_word_embeddings=True)
    return save_tiny_model(LlamaForCausalLM, config, path, seed)
