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

from kvstage.testing.tiny_gemma3 import (
    BOS_ID,
    EOS_ID,
    HEAD_DIM,
    HIDDEN_SIZE,
    MAX_POSITION_EMBEDDINGS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    PAD_ID,
    VOCAB_SIZE,
    build_word_tokenizer,
)


def build_tiny_llama(path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny Llama to ``path`` (created if missing) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=2 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    build_word_tokenizer(out)
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
